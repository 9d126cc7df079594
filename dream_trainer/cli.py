"""The ``dream-trainer`` command line (also ``python -m dream_trainer``)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path


def _export(args: argparse.Namespace) -> int:
    from dream_trainer.checkpoint import CheckpointError, export_checkpoint

    try:
        written = export_checkpoint(args.checkpoint, args.out_dir)
    except CheckpointError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    for model, path in written.items():
        print(f"{model}: {path}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dream-trainer",
                                     description="dream_trainer utilities")
    commands = parser.add_subparsers(dest="command", required=True)
    export = commands.add_parser(
        "export", help="write one safetensors file of weights per model from a checkpoint",
        description="Consolidate a (sharded) checkpoint into <out_dir>/<model>.safetensors, "
                    "loadable into a plain nn.Module. Runs in one process.")
    export.add_argument("checkpoint", type=Path, help="a step_<N> checkpoint directory")
    export.add_argument("out_dir", type=Path, help="where to write the .safetensors files")
    export.set_defaults(run=_export)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.run(args))
