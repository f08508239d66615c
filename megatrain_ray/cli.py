"""The ``megatrain-ray`` command line: ``megatrain-ray train [--config FILE.yaml] [--set key=value ...]``.

Also ``train --resume RUN_DIR_OR_CHECKPOINT``, ``plan`` (the run a config resolves to and the memory it needs, see
:mod:`megatrain_ray.orchestration.resolve`), ``plot RUN_DIR`` (PNG plots of runs/<id>/metrics.jsonl),
``export RUN_DIR_OR_CHECKPOINT --out DIR`` (a Hugging Face model directory, see
:mod:`megatrain_ray.io.hf_io`), ``eval RUN_DIR_OR_CHECKPOINT`` (held-out loss and perplexity, see
:mod:`megatrain_ray.io.evaluate`) and ``bench`` (what a run of a model does on this machine: s/step,
tokens/s, TFLOPS, memory; the options of :mod:`megatrain_ray.bench`). Comparisons with other
systems (GPU-resident PyTorch, DeepSpeed, FSDP2) are a harness outside the package:
``python benchmarks/compare.py``.

With no arguments, ``train`` runs the built-in tiny preset (a 2-layer byte-level model on the
generated corpus) on the Ray cluster running on this machine, or on a private one started for it
(:mod:`megatrain_ray.orchestration.cluster`); as a Ray job, a relative train.run_dir is taken from
~/megatrain-ray. User errors print one ``error:`` line and exit with status 2; an interrupted run
exits with 130 after cleaning up.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

from .errors import MegatrainError
from .orchestration.console import say


DESCRIPTION = ("Train Hugging Face language models through a pipeline of Ray actors: parameters and AdamW state in "
               "host RAM, one GPU streaming one layer at a time. Run `megatrain-ray COMMAND --help` for a command's "
               "options.")


def parse_size(text: str) -> int:
    """``2147483648``, ``500MB``, ``2GiB``, ``1.5G`` -> bytes (K/M/G/T: powers of 1000 with B, 1024 with iB or
    alone)."""
    import re

    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([KMGT]?)(i?B?)\s*", text, re.I)
    if not m or (m.group(3).lower() == "i"):
        raise argparse.ArgumentTypeError(f"{text!r} is not a size; give bytes or a size like 500MB or 2GiB")
    power = "KMGT".find(m.group(2).upper()) + 1 if m.group(2) else 0
    base = 1000 if m.group(3).upper() == "B" and power else 1024
    return int(float(m.group(1)) * base ** power)  # 0 is refused by the export, in its own sentence


def _parser() -> argparse.ArgumentParser:
    from . import __version__

    parser = argparse.ArgumentParser(prog="megatrain-ray", description=DESCRIPTION)
    parser.add_argument("--version", action="version", version=f"megatrain-ray {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    train = sub.add_parser("train", help="train a model through the Ray actor pipeline",
                           description="Train a model through the Ray actor pipeline: the built-in tiny preset with "
                                       "no options, else a YAML config with --set overrides; Ctrl-C or SIGTERM saves "
                                       "a checkpoint first.")
    train.add_argument("--config", help="YAML file of a run's sections (model, optim, train, data, memory, ...)")
    train.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                       help="override one config field, e.g. --set optim.lr=1e-3 (repeatable)")
    train.add_argument("--resume", metavar="RUN_DIR_OR_CHECKPOINT",
                       help="continue from a checkpoint (a run directory: its newest one), in that run's own "
                            "directory; its config is the base that --config and --set override")
    plan = sub.add_parser("plan", help="print the run a config resolves to on this machine: its settings and the "
                                       "host RAM, /dev/shm and GPU memory it needs",
                          description="Print the run a config resolves to on this machine (its settings, and the "
                                      "host RAM, /dev/shm and GPU memory it needs) and whether it fits (exit status "
                                      "2 if not), without starting anything.")
    plan.add_argument("--config", help="YAML file of a run's sections (model, optim, train, data, memory, ...)")
    plan.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                      help="override one config field (repeatable)")
    plan.add_argument("--device", choices=("cpu", "cuda"), help="plan for this device (default: compute.device, "
                      "auto meaning cuda when a GPU is visible)")
    plan.add_argument("--gpu-memory", type=float, metavar="GIB",
                      help="GPU memory to plan for, in GiB (default: what is free on GPU 0 now, if visible, "
                           "as a run would find it)")
    plan.add_argument("--host-memory", type=float, metavar="GIB",
                      help="host RAM available to plan for, in GiB (default: what this machine has available)")
    plan.add_argument("--gpu-tflops", type=float, metavar="TFLOPS",
                      help="the GPU's nominal bf16 dense rate: the expected step time's rates, measured on an "
                           "H200, are scaled by it over the H200's 989 (default: by the GPU's name)")
    plot = sub.add_parser("plot", help="write PNG plots (loss, throughput, stage busy time) of a run",
                          description="Write PNG plots (loss, throughput, stage busy time) of a run's metrics.jsonl.")
    plot.add_argument("run_dir", metavar="RUN_DIR", help="a run directory (runs/<run id>) with a metrics.jsonl")
    plot.add_argument("--out", help="directory for the PNG files (default: RUN_DIR/plots)")
    export = sub.add_parser("export", help="write a run's (or checkpoint's) weights as a Hugging Face model "
                            "directory: sharded safetensors, config.json, tokenizer",
                            description="Write a run's (or checkpoint's) weights as a Hugging Face model directory "
                                        "(sharded safetensors, config.json, the tokenizer) that transformers' "
                                        "from_pretrained loads; also generation_config.json where the run's base "
                                        "model (train.init_from) has one or the tokenizer's chat template ends a "
                                        "turn with a token other than EOS (a run from scratch with the built-in "
                                        "byte-level tokenizer has none: config.json names its EOS).")
    export.add_argument("src", metavar="RUN_DIR_OR_CHECKPOINT",
                        help="a run directory (its final weights, else its newest checkpoint) or a checkpoint "
                             "directory; a LoRA run's checkpoint is exported as the base with its adapters merged "
                             "in, and the adapters (PEFT) in OUT/adapter")
    export.add_argument("--out", required=True, help="new directory to write (a relative path is taken from the "
                        "current directory; the path written is printed)")
    export.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), help="cast (default: as stored)")
    export.add_argument("--shard-size", type=parse_size, default=2 * 2**30, metavar="SIZE",
                        help="largest shard file: bytes, or a size like 500MB or 2GiB (default: 2GiB)")
    export.add_argument("--tokenizer", help="tokenizer directory to include (default: the run's)")
    ev = sub.add_parser("eval", help="loss and perplexity of a run's (or checkpoint's) weights on held-out data",
                        description="Loss and perplexity of a run's (or checkpoint's) weights on its held-out data "
                                    "(or the data --config/--set name).")
    ev.add_argument("src", metavar="RUN_DIR_OR_CHECKPOINT",
                    help="a run directory (its final weights, else its newest checkpoint) or a checkpoint directory")
    ev.add_argument("--config", help="YAML file overriding the run's data settings")
    ev.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                    help="override one config field, e.g. --set data.val_path=held_out.jsonl (repeatable)")
    ev.add_argument("--split", choices=("val", "train"), default="val", help="which split (default: val)")
    ev.add_argument("--batch-size", type=int, default=8, help="sequences per forward pass")
    ev.add_argument("--max-batches", type=int, help="stop after this many batches (default: all)")
    for name, help_line in _FORWARDED.items():
        sub.add_parser(name, help=help_line, add_help=False)  # its own parser describes its options
    return parser


_FORWARDED = {
    "bench": "measure a run of a preset, a run config or an HF model on this machine: s/step, tokens/s, TFLOPS, "
             "memory (megatrain-ray bench --help)",
}
"""Commands whose arguments go to a module's own ``main`` unparsed: their help lines."""


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    forwarded = argv[0] if argv and argv[0] in _FORWARDED else None
    args = None if forwarded else _parser().parse_args(argv)
    try:
        if forwarded:
            from . import bench

            return bench.main(argv[1:])
        if args.command == "train":
            from .io.hf_io import load_train_config
            from .orchestration.cluster import job_path
            from .orchestration.pipeline import train

            resume = None
            if args.resume is not None:
                from .io.resume import resume_config

                cfg, resume, _ = resume_config(args.resume, args.config, args.overrides)
            else:
                cfg = load_train_config(args.config, args.overrides)
            cfg = dataclasses.replace(cfg, train=dataclasses.replace(
                cfg.train, run_dir=job_path(cfg.train.run_dir, "train.run_dir")))
            train(cfg, resume=resume)
        elif args.command == "plan":
            return _plan(args)
        elif args.command == "export":
            from .io.hf_io import export
            from .lora_export import export_lora, lora_checkpoint_of

            adapters = lora_checkpoint_of(args.src)
            if adapters is not None:  # the adapters alone: merged into the base the run took
                out = export_lora(adapters, args.out, args.shard_size, args.dtype, args.tokenizer)
                print(f"exported {out['source']} to {os.path.abspath(out['out'])}: the base with the LoRA adapters "
                      f"merged in, {out['shards']} shard(s) {out['dtype']}; the adapters (PEFT) in "
                      f"{os.path.abspath(out['adapter'])}")
                return 0
            out = export(args.src, args.out, args.shard_size, args.dtype, args.tokenizer)
            print(f"exported {out['source']} to {os.path.abspath(out['out'])}: {out['tensors']} tensors, {out['shards']} shard(s), "
                  f"{out['bytes'] / 2**20:,.1f} MiB {out['dtype']}; tokenizer and config files: "
                  f"{', '.join(out['copied']) or 'none'}")
        elif args.command == "eval":
            from .io.evaluate import run_eval
            from .orchestration.cluster import connect_ray

            run_eval(args.src, args.config, args.overrides, args.split, args.batch_size, args.max_batches,
                     connect=connect_ray)
        elif args.command == "plot":
            from .plot import plot_run

            for path in plot_run(args.run_dir, args.out):
                print(path)
        return 0
    except MegatrainError as e:
        say(f"error: {e}")
        return 2
    except KeyboardInterrupt as e:
        saved = getattr(e, "checkpoint", None)
        if saved:
            from .io.checkpoint import advice

            say(f"interrupted: the run was stopped after saving a checkpoint to {saved} ({advice(saved)}) "
                "and its shared memory removed.")
        else:
            why = getattr(e, "note", "")
            say(f"interrupted: the run was stopped{f' without a checkpoint ({why})' if why else ''} "
                "and its shared memory removed.")
        return 130
    finally:
        calm_exit()


def calm_exit() -> None:
    """Ignore Ctrl-C while the process exits: registered after Ray's own exit handler (``ray.shutdown``,
    registered when ray is imported), so it runs first, and a Ctrl-C pressed again once the run has
    ended (its checkpoint saved, its shared memory removed) cannot break Ray's shutdown with an
    "Exception ignored in atexit callback" traceback. Nothing to do where Ray was not imported."""
    import atexit

    if "ray" in sys.modules:
        atexit.unregister(_ignore_interrupts)
        atexit.register(_ignore_interrupts)


def _ignore_interrupts() -> None:
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _plan(args) -> int:
    """``plan``: print the resolved run (the settings its roles get, the memory table); exit status 2
    (and one error line) if the run would not fit."""
    from .io.hf_io import load_train_config
    from .orchestration.cluster import cluster_to_join
    from .orchestration.resolve import Facts, resolve
    from .orchestration.splits import split_note

    cfg = load_train_config(args.config, args.overrides)
    gpu = None if args.gpu_memory is None else int(args.gpu_memory * 2**30)
    host = None if args.host_memory is None else int(args.host_memory * 2**30)
    run = resolve(cfg, Facts.here(cfg, args.device, gpu, starts_ray=cluster_to_join(cfg.cluster)[0] is None,
                                  device_tflops=args.gpu_tflops, host_bytes=host))
    print(run.describe())
    note = split_note(run)
    if note:
        print(note)
    problems = run.memory.problems()
    if problems:
        print(f"error: {problems[0]}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
