"""DistributedWorld: environment parsing, mesh resolution, single-process launch."""

from __future__ import annotations

import random

import pytest
import torch
import torch.distributed as dist

from dream_trainer.configs import DeviceParameters
from dream_trainer.world import (DistributedWorld, LaunchEnvironment, MeshAxis,
                                 MeshMismatchError, ParallelDims)


def test_plain_python_is_a_world_of_one() -> None:
    env = LaunchEnvironment.from_environ({})
    assert env == LaunchEnvironment(0, 0, 1, 1, False, 0)


def test_torchrun_variables_are_read() -> None:
    env = LaunchEnvironment.from_environ({
        "RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
        "TORCHELASTIC_RESTART_COUNT": "2"})
    assert (env.rank, env.world_size, env.local_rank, env.local_world_size) == (3, 4, 1, 2)
    assert env.launched and env.restart_count == 2


@pytest.mark.parametrize("environ", [{"RANK": "0"}, {"RANK": "x", "WORLD_SIZE": "2"},
                                     {"RANK": "2", "WORLD_SIZE": "2"}])
def test_inconsistent_launcher_variables_are_rejected(environ: dict[str, str]) -> None:
    with pytest.raises(ValueError, match="RANK"):
        LaunchEnvironment.from_environ(environ)


@pytest.mark.parametrize(("params", "world_size", "expected"), [
    (DeviceParameters(), 1, (1, 1, 1, 1, 1)),
    (DeviceParameters(), 8, (1, 8, 1, 1, 1)),
    (DeviceParameters.FSDP(), 4, (1, 1, 4, 1, 1)),
    (DeviceParameters.HSDP(dp_shard=2), 8, (1, 4, 2, 1, 1)),
    (DeviceParameters(dp_shard=2, tensor_parallel="auto"), 8, (1, 1, 2, 1, 4)),
])
def test_auto_degree_takes_what_the_world_leaves(params: DeviceParameters, world_size: int,
                                                 expected: tuple[int, ...]) -> None:
    dims = ParallelDims.resolve(params, world_size)
    assert (dims.pp, dims.dp_replicate, dims.dp_shard, dims.cp, dims.tp) == expected
    assert dims.world_size == world_size


@pytest.mark.parametrize(("params", "world_size", "message"), [
    (DeviceParameters.SINGLE_DEVICE(), 2, "has 1 ranks but the world size is 2"),
    (DeviceParameters(dp_replicate=2, tensor_parallel=2), 2, "has 4 ranks"),
    (DeviceParameters(tensor_parallel=3), 2, "multiply to 3, which does not divide 2"),
])
def test_mesh_mismatch_is_raised_before_any_collective(params: DeviceParameters,
                                                       world_size: int, message: str) -> None:
    env = LaunchEnvironment(rank=0, world_size=world_size, local_world_size=world_size,
                            launched=True)
    with pytest.raises(MeshMismatchError, match=message):
        DistributedWorld(params, env)
    assert not dist.is_initialized()


def test_single_process_launch_creates_and_destroys_its_group() -> None:
    world = DistributedWorld(DeviceParameters(), LaunchEnvironment())
    assert world.device == torch.device("cpu") and world.backend == "gloo"
    world.launch()
    try:
        assert dist.is_initialized() and dist.get_world_size() == 1
        assert world.mesh is None and world.dp_mesh is None
        assert (world.dp_rank, world.dp_size) == (0, 1)
        tensor = torch.ones(3)
        dist.all_reduce(tensor)
        assert torch.equal(tensor, torch.ones(3))
    finally:
        world.shutdown()
    assert not dist.is_initialized()


def test_an_existing_group_is_reused_and_left_alone() -> None:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        world = DistributedWorld(DeviceParameters(), LaunchEnvironment())
        world.launch()
        world.shutdown()
        assert dist.is_initialized()
    finally:
        dist.destroy_process_group()


def test_seed_makes_every_generator_repeat() -> None:
    world = DistributedWorld(DeviceParameters(), LaunchEnvironment())
    np = pytest.importorskip("numpy")
    world.seed(7)
    first = (random.random(), np.random.rand(), torch.rand(2))
    world.seed(7)
    second = (random.random(), np.random.rand(), torch.rand(2))
    assert first[:2] == second[:2] and torch.equal(first[2], second[2])


def test_mesh_axes_are_ordered_with_tp_innermost() -> None:
    dims = ParallelDims(pp=1, dp_replicate=2, dp_shard=2, cp=1, tp=2)
    assert dims.mesh_axes() == [(MeshAxis.DP_REPLICATE, 2), (MeshAxis.DP_SHARD, 2),
                                (MeshAxis.TP, 2)]
    assert dims.dp == 4 and str(MeshAxis.TP) == "tp"


def test_cuda_request_without_cuda_is_a_clear_error() -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(ValueError, match="no CUDA device"):
        DistributedWorld(DeviceParameters(device="cuda"), LaunchEnvironment())
