"""``dream-trainer export``: one safetensors file of weights per model from a checkpoint."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any


def add_parser(commands: Any) -> argparse.ArgumentParser:
    parser = commands.add_parser(
        "export", allow_abbrev=False,
        help="write one safetensors file of weights per model from a checkpoint",
        description="Consolidate a (sharded) checkpoint into <out_dir>/<model>.safetensors, "
                    "loadable into a plain nn.Module. Runs in one process.")
    parser.add_argument("checkpoint", type=Path, help="a step_<N> checkpoint directory")
    parser.add_argument("out_dir", type=Path, help="where to write the .safetensors files")
    parser.set_defaults(run=run, takes_overrides=False)
    return parser


def run(args: argparse.Namespace, overrides: list[str]) -> int:
    from dream_trainer.checkpoint import CheckpointError, export_checkpoint

    try:
        written = export_checkpoint(args.checkpoint, args.out_dir)
    except CheckpointError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    for model, path in written.items():
        print(f"{model}: {path}")
    return 0
