"""The run of a command on the TARGET's trainer: load, run on every rank, report on rank 0."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import TypeVar

from dream_trainer.cli.target import load_trainer
from dream_trainer.trainer.base import BaseTrainer

T = TypeVar("T")


def run_tool(args: argparse.Namespace, overrides: list[str],
             session: Callable[[argparse.Namespace, BaseTrainer], T],
             report: Callable[[argparse.Namespace, BaseTrainer, T], int], *,
             one_process: bool = False) -> int:
    """Build the trainer ``args.target`` names with ``overrides``, run ``session`` on it on
    every rank, and ``report`` its result on rank 0.

    Args:
        args: The command's arguments (``target`` and ``command`` among them).
        overrides: Config overrides for the trainer's factory.
        session: Sets the trainer up (or trains it) and tears it down; collectives belong here.
        report: Prints what ``session`` returned; its result is the exit status.
        one_process: Refuse a trainer whose world has several processes (torchrun).

    Returns:
        ``report``'s exit status on rank 0, 0 on the other ranks, 2 when ``one_process``
        refuses the run.
    """
    trainer = load_trainer(args.target, overrides)
    if one_process and trainer.world.world_size > 1:
        print(f"dream-trainer {args.command}: error: it runs in one process; run it with "
              "python, not torchrun", file=sys.stderr)
        return 2
    result = session(args, trainer)
    if not trainer.world.is_rank_zero:
        return 0
    return report(args, trainer, result)


def stopped_early(trainer: BaseTrainer, before: str) -> int:
    """Say on stderr that training ended ``before`` what the command needed; return 1.

    Args:
        trainer: The trainer, after its run.
        before: What was missing (``"the 25 asked for"``).
    """
    print(f"error: training ended after {trainer.global_step} optimizer steps, before "
          f"{before} (a callback stopped it)", file=sys.stderr)
    return 1
