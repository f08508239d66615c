"""The ``megatrain-ray`` command line: ``megatrain-ray train [--config FILE.yaml] [--set key=value ...]``.

With no arguments, ``train`` runs the built-in tiny preset (a 2-layer byte-level model on the
generated corpus) on a local Ray started for it. User errors print one ``error:`` line and exit
with status 2; an interrupted run exits with 130 after cleaning up.
"""

from __future__ import annotations

import argparse
import sys

from .errors import MegatrainError


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="megatrain-ray", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser("train", help="train a model through the Ray actor pipeline")
    train.add_argument("--config", help="YAML file with model/optim/train/data/runtime sections")
    train.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                       help="override one config field, e.g. --set optim.lr=1e-3 (repeatable)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.command == "train":
            from .config import load_config
            from .pipeline import train

            cfg = load_config(args.config, args.overrides)
            train(cfg)
        return 0
    except MegatrainError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted: the run was stopped and its shared memory removed.", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
