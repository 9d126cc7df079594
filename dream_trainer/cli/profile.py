"""``dream-trainer profile``: a ``torch.profiler`` trace of a few optimizer steps."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from dream_trainer.callbacks.profiler import Profiler
from dream_trainer.cli.arguments import add_target, positive_int
from dream_trainer.cli.target import load_trainer
from dream_trainer.planning.session import train_steps


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
    trainer = load_trainer(args.target, overrides)
    total = args.warmup + args.steps
    profiler = Profiler(start_step=args.warmup, num_steps=args.steps, output_dir=args.out)
    train_steps(trainer, total, profiler)
    if not trainer.world.is_rank_zero:
        return 0
    if profiler.trace_path is None or profiler.summary_path is None:
        print(f"error: training ended after {trainer.global_step} optimizer steps, before the "
              "profiler recorded any (a callback stopped it)", file=sys.stderr)
        return 1
    print(f"top operators by self CPU time (optimizer steps {args.warmup + 1}-{total}, rank 0):")
    print(profiler.summary_path.read_text().rstrip())
    print(f"trace: {profiler.trace_path} (one trace_rank<r>.json per rank; open it in "
          "https://ui.perfetto.dev or chrome://tracing)")
    return 0
