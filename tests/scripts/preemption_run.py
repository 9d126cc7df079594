"""torchrun script: PreemptionAgreement.poll on 2 ranks whose steps take different times (a
fake clock: rank 0's steps 1/64 s, rank 1's 1/32 s), rank 1's flag set before step FLAG_STEP.
Each rank writes OUT/rank<R>.json: for each cadence, the step at which poll() first said
True, the steps at which the ranks voted, and the votes.

Usage: preemption_run.py OUT"""

from __future__ import annotations

import json
import signal
import sys
from pathlib import Path

import torch.distributed as dist

from dream_trainer.utils.preemption import PreemptionAgreement, PreemptionFlag

FLAG_STEP = 23


class FakeClock:
    def __init__(self, step_seconds: float) -> None:
        self.now, self.step_seconds = 0.0, step_seconds

    def __call__(self) -> float:
        return self.now


def run(seconds: float, rank: int, group: dist.ProcessGroup) -> dict[str, object]:
    clock, flag = FakeClock(1 / 64 if rank == 0 else 1 / 32), PreemptionFlag()
    agreement = PreemptionAgreement(flag, group, seconds=seconds, clock=clock)
    voted_at = []
    for step in range(1, 400):
        clock.now += clock.step_seconds  # the step's training
        if rank == 1 and step == FLAG_STEP:
            flag.signal = signal.SIGTERM  # as the handler records it
        polls = agreement.polls
        stop = agreement.poll()
        if agreement.polls > polls:
            voted_at.append(step)
        if stop:
            agreement.finish()
            return {"stopped_at": step, "voted_at": voted_at, "votes": agreement.polls}
    raise AssertionError("the ranks never agreed")


if __name__ == "__main__":
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    try:
        group = dist.new_group(backend="gloo")
        # 10/64 s: 10 of rank 0's steps, 5 of rank 1's; the ranks take 5.
        seen = {"every_step": run(0.0, rank, group), "adaptive": run(10 / 64, rank, group),
                "capped": run(1000.0, rank, group)}
        Path(sys.argv[1], f"rank{rank}.json").write_text(json.dumps(seen))
    finally:
        dist.barrier()
        dist.destroy_process_group()
