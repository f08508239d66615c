"""Benchmarks and harnesses that live outside the installed package: the DeepSpeed / FSDP2 peers
(peers.py), the data-loader throughput (data_bench.py), real-text convergence (convergence.py), the
device scripts (*.sh) and their results (one directory per session). Run them as scripts from the
repository root (``python benchmarks/peers.py --help``); megatrain_ray never imports them."""
