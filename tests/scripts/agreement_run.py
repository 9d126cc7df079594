"""torchrun script: every function of dream_trainer.world.agree, and the world's group
helpers, on real ranks. Each rank writes what it saw to OUT/rank<R>.json (a file each:
two ranks printing to one pipe can interleave their lines).

Usage: agreement_run.py OUT"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from dream_trainer.configs import DeviceParameters
from dream_trainer.world import DistributedWorld, MeshAxis
from dream_trainer.world.agree import (agree_any, agree_max, agree_min, barrier,
                                       from_rank_zero, gather_objects, is_distributed,
                                       is_launched, is_rank_zero)


def ranks_of(group: dist.ProcessGroup | None) -> list[int] | None:
    return None if group is None else dist.get_process_group_ranks(group)


if __name__ == "__main__":
    world = DistributedWorld(DeviceParameters(dp_shard=2))
    world.launch()
    try:
        rank, device = world.rank, world.device
        # A group of this rank alone: every rank creates both, in the same order.
        alone = [dist.new_group([r]) for r in range(world.world_size)][rank]
        verdict = torch.tensor(rank * 3, device=device)
        seen = {
            "launched": is_launched(), "distributed": is_distributed(),
            "distributed_alone": is_distributed(alone), "rank_zero": is_rank_zero(),
            "any_rank_one": agree_any(rank == 1, device), "any_none": agree_any(False, device),
            "any_alone": agree_any(rank == 1, device, alone),
            "min": agree_min(10 + rank, device), "max": agree_max(10 + rank, device),
            "max_tensor": agree_max(verdict, device), "tensor_after": int(verdict),
            "min_tensor": agree_min(verdict, device),
            "gathered": gather_objects({"rank": rank}),
            "from_zero": from_rank_zero(f"rank {rank}'s value"),
            "dp_group": ranks_of(world.dp_group),
            "dp_shard_group": ranks_of(world.get_group(MeshAxis.DP_SHARD)),
            "pp_group": ranks_of(world.get_group(MeshAxis.PP)),
        }
        barrier(alone)
        barrier()
        (Path(sys.argv[1]) / f"rank{rank}.json").write_text(json.dumps(seen))
    finally:
        world.shutdown()
