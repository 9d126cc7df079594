"""torchrun script: DDP where one rank sleeps in every training_step; ``Throughput`` must name
it. Each rank saves what it saw (logged values, warnings, all_gather calls) to
``<out_dir>/rank<R>.pt``.

Usage: straggler_run.py OUT_DIR SLOW_RANK SLEEP_SECONDS WINDOW STEPS
"""

from __future__ import annotations

import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from dream_trainer.callbacks.throughput import Throughput
from tests.helpers.toy import RecordingLogger, ToyTrainer, logged_toy_config


class SlowRankTrainer(ToyTrainer, RecordingLogger):
    """Rank ``slow_rank`` sleeps ``sleep`` seconds at the start of every training_step."""

    slow_rank = 1
    sleep = 0.0

    def training_step(self, batch: Any, batch_idx: int) -> dict[str, Any]:
        if self.world.rank == self.slow_rank:
            time.sleep(self.sleep)
        return super().training_step(batch, batch_idx)


class Warnings(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def main(out_dir: str, slow_rank: str, sleep: str, window: str, steps: str) -> None:
    gathers = 0
    all_gather = dist.all_gather

    def counting_all_gather(*args: Any, **kwargs: Any) -> Any:
        nonlocal gathers
        gathers += 1
        return all_gather(*args, **kwargs)

    dist.all_gather = counting_all_gather  # type: ignore[assignment]
    warnings = Warnings()
    logging.getLogger("dream_trainer.callbacks.throughput").addHandler(warnings)

    SlowRankTrainer.slow_rank, SlowRankTrainer.sleep = int(slow_rank), float(sleep)
    world_size = int(os.environ["WORLD_SIZE"])
    throughput = Throughput(window=int(window), straggler_threshold=0.2, straggler_windows=3)
    trainer = SlowRankTrainer(logged_toy_config(
        callbacks=[throughput], optimizer="sgd", train_batch_size=8,
        n_samples=8 * world_size * int(steps), train_steps_per_epoch=int(steps)))
    trainer.fit()
    torch.save({"logged": trainer.logged, "warnings": warnings.lines, "gathers": gathers,
                "spread": throughput.spread, "global_step": trainer.global_step},
               Path(out_dir) / f"rank{trainer.world.rank}.pt")


if __name__ == "__main__":
    main(*sys.argv[1:])
