"""Benchmarks and harnesses that live outside the installed package: recipes named by the question
they answer (*.sh, convergence.py, checkpoint_cost.py), the comparison harness (compare.py, peers.py,
reference.py, gpu_check.py, probes.py) and the results that back the documents' figures (results/).
See benchmarks/README.md. Run them from the repository root; megatrain_ray never imports them."""
