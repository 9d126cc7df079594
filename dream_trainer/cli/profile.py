"""``dream-trainer profile``: a ``torch.profiler`` trace of a few optimizer steps."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from dream_trainer.callbacks.profiler import Profiler
from dream_trainer.cli.arguments import add_target, positive_int
from dream_trainer.cli.tool_run import run_tool, stopped_early
from dream_trainer.planning.session import train_steps
from dream_trainer.trainer.base import BaseTrainer


def add_parser(commands: Any) -> argparse.ArgumentParser:
    parser = commands.add_parser(
        "profile", allow_abbrev=False,
        help="profile a few optimizer steps; write a Chrome trace and print the top operators",
        description="Train for WARMUP + STEPS optimizer steps with the Profiler callback: the "
                    "last warm-up step warms the profiler up, the next STEPS are recorded. "
                    "Every rank writes DIR/trace_rank<r>.json (chrome://tracing, Perfetto) and "
                    "DIR/summary_rank<r>.txt; rank 0 prints its operator table, sorted by self "
                    "CPU time. Checkpoints and logs are kept out of the run's directories as "
                    "with benchmark.")
    add_target(parser)
    parser.add_argument("--steps", type=positive_int, default=3, metavar="N",
                        help="optimizer steps recorded (default: 3)")
    parser.add_argument("--warmup", type=positive_int, default=2, metavar="W",
                        help="optimizer steps run before recording, the last of them with the "
                             "profiler warming up (default: 2)")
    parser.add_argument("--out", type=Path, default=Path("profile"), metavar="DIR",
                        help="directory for the traces and tables (default: ./profile)")
    parser.set_defaults(run=run)
    return parser


def run(args: argparse.Namespace, overrides: list[str]) -> int:
    return run_tool(args, overrides, _record, _print)


def _record(args: argparse.Namespace, trainer: BaseTrainer) -> Profiler:
    profiler = Profiler(start_step=args.warmup, num_steps=args.steps, output_dir=args.out)
    train_steps(trainer, args.warmup + args.steps, profiler)
    return profiler


def _print(args: argparse.Namespace, trainer: BaseTrainer, profiler: Profiler) -> int:
    if profiler.trace_path is None or profiler.summary_path is None:
        return stopped_early(trainer, "the profiler recorded any")
    print(f"top operators by self CPU time (optimizer steps {args.warmup + 1}-"
          f"{args.warmup + args.steps}, rank 0):")
    print(profiler.summary_path.read_text().rstrip())
    print(f"trace: {profiler.trace_path} (one trace_rank<r>.json per rank; open it in "
          "https://ui.perfetto.dev or chrome://tracing)")
    return 0
