"""A simulated world: one process as one rank of a large job on torch's fake backend."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from dream_trainer.configs import DeviceParameters
from dream_trainer.planning.simulate import ShapesOnly
from dream_trainer.world import DistributedWorld, LaunchEnvironment


def test_an_activated_environment_reaches_worlds_built_in_the_block_only() -> None:
    env = LaunchEnvironment(rank=777, local_rank=1, world_size=1024, local_world_size=8,
                            launched=True, backend="fake")
    environ = dict(os.environ)
    with env.activate() as active:
        assert active is env and LaunchEnvironment.current() is env
        world = DistributedWorld(DeviceParameters(dp_shard="auto", tensor_parallel=8))
        assert (world.rank, world.world_size, world.dims.dp_shard) == (777, 1024, 128)
        assert world.simulated and world.backend == "fake"
        assert dict(os.environ) == environ  # nothing written where torchrun writes
    assert LaunchEnvironment.current() == LaunchEnvironment.from_environ()
    assert not DistributedWorld(DeviceParameters()).simulated


def test_a_simulated_rank_launches_the_whole_mesh_and_fake_groups_in_one_process() -> None:
    env = LaunchEnvironment(rank=1023, world_size=1024, local_world_size=8, launched=True,
                            backend="fake")
    world = DistributedWorld(DeviceParameters(dp_shard="auto", tensor_parallel=8), env)
    shapes = world.materialization = ShapesOnly()  # what plan passes to set_up()
    world.launch()
    try:
        assert dist.get_world_size() == 1024 and dist.get_rank() == 1023
        assert world.mesh is not None and world.mesh.shape == (128, 8)
        assert tuple(world.mesh.get_coordinate() or ()) == (127, 7)
        group = world.new_group("gloo")  # a gloo group would wait for 1,023 absent peers
        assert dist.get_backend(group) == "fake"
        assert not world.materialization.has_values
        with world.materialization.context():
            huge = torch.empty(1 << 40)  # 4 TiB of shape, no storage
        assert huge.untyped_storage().nbytes() == 4 << 40
    finally:
        world.shutdown()
    assert not dist.is_initialized() and world.materialization is not shapes
    assert world.materialization.has_values  # a tool's choice lasts one run


def test_a_real_world_materializes_real_tensors() -> None:
    world = DistributedWorld(DeviceParameters(), LaunchEnvironment())
    world.launch()
    try:
        assert world.materialization.has_values and not world.simulated and world.backend == "gloo"
        assert dist.get_backend(world.new_group()) == "gloo"
    finally:
        world.shutdown()
