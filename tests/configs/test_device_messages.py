"""Refusals of DeviceParameters name a fix that works for the degrees as given: an
``expert_parallel`` that a ``dp_shard='auto'`` cannot lend to names the world size or the
degrees that fit, not 'auto' again; ``cpu_offload`` names what FSDP2 needs."""

from __future__ import annotations

import re

import pytest
from pydantic import ValidationError

from dream_trainer.configs import DeviceParameters
from dream_trainer.world import DistributedWorld, LaunchEnvironment, MeshMismatchError


def world(world_size: int, **fields: object) -> DistributedWorld:
    return DistributedWorld(DeviceParameters(**fields),  # type: ignore[arg-type]
                            env=LaunchEnvironment(world_size=world_size, launched=True))


@pytest.mark.parametrize(("fields", "world_size", "message", "works"), [
    ({"expert_parallel": 3}, 2,
     "expert_parallel=3 borrows its ranks from dp_shard, so dp_shard must be a multiple of 3, "
     "got dp_shard=2: dp_shard='auto' takes the ranks the other degrees leave, so launch a "
     "multiple of 3 processes, or set expert_parallel to one of [1, 2] (dp_shard='auto' is 2 "
     "on 2 ranks)", [(3, {}), (6, {}), (2, {"expert_parallel": 2})]),
    ({"expert_parallel": 4, "context_parallel": 2}, 6,
     "expert_parallel=4 borrows its ranks from dp_shard (and context_parallel=2), so dp_shard "
     "must be a multiple of 2, got dp_shard=3: dp_shard='auto' takes the ranks the other "
     "degrees leave, so launch a multiple of 4 processes, or set expert_parallel to one of "
     "[2, 6] (dp_shard='auto' is 3 on 6 ranks)",
     [(4, {}), (8, {}), (6, {"expert_parallel": 6}), (6, {"expert_parallel": 2})]),
    ({"expert_parallel": 4, "tensor_parallel": 2}, 4,
     "expert_parallel=4 borrows its ranks from dp_shard, so dp_shard must be a multiple of 4, "
     "got dp_shard=2: dp_shard='auto' takes the ranks the other degrees leave, so launch a "
     "multiple of 8 processes, or set expert_parallel to one of [1, 2] (dp_shard='auto' is 2 "
     "on 4 ranks)", [(8, {}), (4, {"expert_parallel": 2})]),
])
def test_expert_parallel_with_dp_shard_auto_advises_a_world_size_or_a_degree_that_works(
        fields: dict[str, object], world_size: int, message: str,
        works: list[tuple[int, dict[str, object]]]) -> None:
    assert DeviceParameters(**fields).dp_shard == "auto"  # type: ignore[arg-type]
    with pytest.raises(MeshMismatchError, match=re.escape(message)):
        world(world_size, **fields)
    # Every fix the message offers resolves.
    for size, change in works:
        dims = world(size, **{**fields, **change}).dims
        assert dims.world_size == size and dims.dp_shard % (dims.ep // dims.cp) == 0


def test_a_fixed_dp_shard_is_told_to_change_it() -> None:
    with pytest.raises(ValidationError, match=re.escape(
            "expert_parallel=2 borrows its ranks from dp_shard, so dp_shard must be a multiple "
            "of 2, got dp_shard=3: set dp_shard to a multiple of 2 or 'auto'")):
        DeviceParameters(expert_parallel=2, dp_shard=3)


def test_cpu_offload_names_when_fsdp2_applies() -> None:
    message = ("cpu_offload=True needs FSDP2 sharding: set dp_shard > 1 (or 'auto' on several "
               "ranks) or context_parallel > 1 (FSDP2 shards over dp_shard x context_parallel), "
               "or turn cpu_offload off")
    with pytest.raises(ValidationError, match=re.escape(message)):
        DeviceParameters(cpu_offload=True)
    # dp_shard='auto' on one process resolves to 1: the same rule, at resolution.
    with pytest.raises(MeshMismatchError, match=re.escape(message)):
        world(1, cpu_offload=True, dp_shard="auto")
    # Context parallelism alone shards with FSDP2, so offload is allowed.
    assert world(2, cpu_offload=True, context_parallel=2).dims.fsdp == 2
