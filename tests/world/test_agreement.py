"""dream_trainer.world.agree: one verdict on every rank, and none of its collectives
without peers; the world's process-group helpers."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from dream_trainer.configs import DeviceParameters
from dream_trainer.world import DistributedWorld, LaunchEnvironment, MeshAxis
from dream_trainer.world.agree import (agree_any, agree_max, agree_min, barrier,
                                       from_rank_zero, gather_objects, is_distributed,
                                       is_launched, is_rank_zero)
from tests.helpers.launch import REPO, check, torchrun

CPU = torch.device("cpu")
COLLECTIVES = ("all_reduce", "all_gather_object", "broadcast_object_list", "barrier")


def answers_alone() -> dict[str, Any]:
    """What every function answers on a rank with no peers."""
    verdict = torch.tensor(4)
    shared = {"key": 1}
    return {
        "distributed": is_distributed(), "rank_zero": is_rank_zero(),
        "any_true": agree_any(True, CPU), "any_false": agree_any(False, CPU),
        "min": agree_min(5, CPU), "max": agree_max(7, CPU),
        "max_tensor": agree_max(verdict, CPU), "min_tensor": agree_min(verdict, CPU),
        "gathered": gather_objects("mine"), "same_object": from_rank_zero(shared) is shared,
        "barrier": barrier(),
    }


ALONE = {"distributed": False, "rank_zero": True, "any_true": True, "any_false": False,
         "min": 5, "max": 7, "max_tensor": 4, "min_tensor": 4, "gathered": ["mine"],
         "same_object": True, "barrier": None}


def test_without_a_process_group_each_rank_answers_for_itself() -> None:
    assert not is_launched()
    assert answers_alone() == ALONE


def test_a_group_of_one_answers_without_any_collective(monkeypatch: pytest.MonkeyPatch) -> None:
    world = DistributedWorld(DeviceParameters(), LaunchEnvironment())
    world.launch()
    try:
        for name in COLLECTIVES:
            monkeypatch.setattr(dist, name, _refuse(name))
        assert is_launched() and world.is_launched
        assert answers_alone() == ALONE
        world.barrier()
        assert (world.dp_group, world.get_group(MeshAxis.PP)) == (None, None)
    finally:
        monkeypatch.undo()
        world.shutdown()
    assert not is_launched() and not world.is_launched


def _refuse(name: str) -> Any:
    def refuse(*args: Any, **kwargs: Any) -> None:
        raise AssertionError(f"{name} called without peers")
    return refuse


def test_two_ranks_reach_one_verdict(tmp_path: Path) -> None:
    check(torchrun(REPO / "tests/scripts/agreement_run.py", [str(tmp_path)], timeout=120))
    seen = {int(path.stem.removeprefix("rank")): json.loads(path.read_text())
            for path in tmp_path.glob("rank*.json")}
    assert sorted(seen) == [0, 1]
    for rank, values in seen.items():
        assert values == {
            "launched": True, "distributed": True, "distributed_alone": False,
            "rank_zero": rank == 0,
            # True on both because rank 1's flag is; False where no rank raised one.
            "any_rank_one": True, "any_none": False,
            # In a group of one rank, each keeps its own flag.
            "any_alone": rank == 1,
            "min": 10, "max": 11,
            # Rank r's tensor holds 3r: the reduction reads it and leaves it as it was.
            "max_tensor": 3, "tensor_after": 3 * rank, "min_tensor": 0,
            "gathered": [{"rank": 0}, {"rank": 1}], "from_zero": "rank 0's value",
            "dp_group": [0, 1], "dp_shard_group": [0, 1], "pp_group": None,
        }, rank
