"""torchrun script: ResultAverager.compute across 2 ranks with AgreedKeys, step by step as the
logged steps use it, against an averager that gathers the keys every time. Each rank writes
OUT/rank<R>.json: per step, both results and how many key gathers the shared one made.

Usage: averaging_run.py OUT"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from dream_trainer.utils import averaging
from dream_trainer.utils.averaging import AgreedKeys, ResultAverager

CPU = torch.device("cpu")


def steps(rank: int) -> list[dict[str, Any]]:
    """This rank's result at each step: the same keys twice, a key on rank 1 only, that key
    gone again, then a key on rank 1 only that the agreed keys already hold."""
    loss, norm = torch.tensor(1.0 + rank), torch.tensor(10.0 * (rank + 1))
    same = {"loss": loss, "norm": norm}
    return [same, same, {**same, "extra": 7.0} if rank == 1 else same, same,
            same if rank == 1 else {"loss": loss}]


if __name__ == "__main__":
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    gathers = 0
    gather = dist.all_gather_object

    def counted(*args: Any, **kwargs: Any) -> None:
        global gathers
        gathers += 1
        gather(*args, **kwargs)

    averaging.dist.all_gather_object = counted  # type: ignore[attr-defined]
    agreed, seen = AgreedKeys(), []
    try:
        for result in steps(rank):
            before = gathers
            shared = ResultAverager(CPU, agreed)
            shared.update(result, weight=2 + rank)  # ranks weigh 2 and 3
            checked = shared.compute()
            made = gathers - before
            fresh = ResultAverager(CPU)
            fresh.update(result, weight=2 + rank)
            seen.append({"checked": checked, "gathered": fresh.compute(), "gathers": made,
                         "agreed": agreed.keys})
        Path(sys.argv[1], f"rank{rank}.json").write_text(json.dumps(seen))
    finally:
        dist.barrier()
        dist.destroy_process_group()
