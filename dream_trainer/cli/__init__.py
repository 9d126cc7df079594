"""The ``dream-trainer`` command line (also ``python -m dream_trainer``).

``summarize``, ``benchmark``, ``profile``, ``plan`` and ``find-graph-breaks`` take a TARGET
naming the user's trainer factory (``path/to/script.py:NAME`` or ``package.module:NAME``)
followed by config overrides for it; ``export`` turns a checkpoint into safetensors files;
``lighthouse`` serves torchft's lighthouse for fault-tolerant replica groups; ``diagnose``
prints the verdict on a hung run from the records ``HangWatchdog`` wrote. See
``docs/cli.md``.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from pydantic import ValidationError

from dream_trainer.cli import (benchmark, diagnose, export, find_graph_breaks, lighthouse, plan,
                               profile, summarize)
from dream_trainer.errors import TargetError

__all__ = ["build_parser", "main"]

EPILOG = """\
TARGET is path/to/script.py:NAME or package.module:NAME, where NAME() returns an unfitted
trainer. Arguments after TARGET that a command does not know (put them after `--` to be
sure) are config overrides, handed to NAME(args), which passes them to apply_cli_overrides:
  dream-trainer benchmark train.py:make_trainer --steps 50 -- --learning_rate 3e-4
Under torchrun every rank runs the command and rank 0 prints:
  torchrun --standalone --nproc_per_node=2 -m dream_trainer summarize train.py:make_trainer
"""

OVERRIDES = ("OVERRIDE arguments go to the factory as a list, NAME(args), which hands them to "
             "apply_cli_overrides (--training_parameters.train_batch_size 64). Put them after "
             "`--` when one has the name of an option above; `-- --help` lists the fields of "
             "the factory's config.")


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser with one subparser per command."""
    parser = argparse.ArgumentParser(
        prog="dream-trainer", allow_abbrev=False, epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Inspect, time, profile, plan and compile-check a dream_trainer trainer; "
                    "export checkpoints; serve the lighthouse of fault-tolerant replica groups; "
                    "diagnose a hung run.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for command in (summarize, benchmark, profile, plan, find_graph_breaks, export, lighthouse,
                    diagnose):
        subparser = command.add_parser(commands)
        if subparser.get_default("takes_overrides"):
            usage = " ".join(subparser.format_usage().split()[1:])
            subparser.usage = f"{usage} [OVERRIDE ...]"
            subparser.epilog = OVERRIDES
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command; return its exit status.

    Returns:
        0 on success; 1 when the command failed; 2 for a bad TARGET or an invalid config
        override (argparse also exits with 2 for a bad option of the command itself).
    """
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    # Everything after the first `--` is an override, taken verbatim: argparse would treat
    # `--` differently depending on what precedes it.
    split = argv.index("--") if "--" in argv else len(argv)
    args, overrides = parser.parse_known_args(argv[:split])
    overrides += argv[split + 1:]
    if overrides and not args.takes_overrides:
        parser.error(f"unrecognized arguments: {' '.join(overrides)}")
    try:
        return int(args.run(args, overrides))
    except TargetError as exc:
        print(f"dream-trainer {args.command}: error: {exc}", file=sys.stderr)
    except ValidationError as exc:
        print(f"dream-trainer {args.command}: error: invalid config: {exc}", file=sys.stderr)
    return 2
