"""StepMemory's accounting, and the plan's activations against torch's own MemTracker."""

from __future__ import annotations

import sys
from collections.abc import Iterator

import pytest
import torch
import torch.nn.functional as F

from dream_trainer.planning.simulate import plan_rank
from dream_trainer.planning.memory import StepMemory, storage_bytes
from tests.scripts.plan_trainer import SEQ, VOCAB, PlannedGPT, make_trainer


@pytest.fixture(autouse=True)
def _restore_path(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setattr(sys, "path", list(sys.path))
    yield


def test_views_cost_nothing_and_resizes_and_frees_move_the_live_bytes() -> None:
    weight = torch.zeros(256)  # created before tracking: a view of it allocates nothing
    with StepMemory() as memory:
        view = weight.view(16, 16).t()
        activation = torch.ones(1024)  # allocation 0, 4 KiB
        doubled = activation * 2  # allocation 1, 4 KiB: 8 KiB live, the peak
        del activation  # 4 KiB live
        storage = doubled.untyped_storage()
        storage.resize_(0)  # as FSDP2 frees an unsharded parameter: nothing live
        storage.resize_(6144)  # and gathers it again, larger: 6 KiB live
        del doubled, storage
    assert view.untyped_storage().nbytes() == 1024
    assert memory.peak() == 8192
    assert memory.peak(excluding=[0]) == 6144  # `doubled` alone, at its largest
    assert memory.peak(excluding=[0, 1]) == 0


def test_storage_bytes_count_shared_storages_once() -> None:
    embedding = torch.nn.Embedding(10, 4)
    head = torch.nn.Linear(4, 10, bias=False)
    head.weight = embedding.weight  # tied
    assert storage_bytes([embedding.weight, head.weight, head.weight.t()]) == 10 * 4 * 4


def test_activations_of_a_single_device_step_match_torchs_mem_tracker() -> None:
    """On one device the plan's activation figure is the peak of every tensor but the
    parameters, gradients and optimizer state, plus the micro-batch. torch's MemTracker,
    run on real tensors, measures the same peak (its activations and temporaries) when the
    peak is the activations' and no gradient exists yet, as with a batch of 64 sequences."""
    from torch.distributed._tools.mem_tracker import MemTracker, _MemRefType

    batch = 64
    plan = plan_rank(lambda: make_trainer([
        "--device_parameters", '{"dp_replicate": 1, "dp_shard": 1}',
        "--training_parameters.train_batch_size", str(batch)]), 1, 0, 1)

    model = PlannedGPT()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tokens = torch.randint(0, VOCAB, (batch, SEQ + 1))
    tracker = MemTracker()
    tracker.track_external(model, optimizer)
    with tracker:
        logits = model(tokens[:, :-1])
        F.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1)).backward()
        del logits
        optimizer.step()
    (peak,) = tracker.get_tracker_snapshot("peak").values()
    assert peak[_MemRefType.GRAD] == 0 and peak[_MemRefType.OPT] == 0  # the case described
    batch_bytes = tokens.numel() * tokens.element_size()
    expected = peak[_MemRefType.ACT] + peak[_MemRefType.TEMP] + batch_bytes
    # Both follow the same storages; they differ only by when a peak is sampled and by the
    # micro-batch, which MemTracker does not see: 1 % covers that.
    assert plan.activation_bytes == pytest.approx(expected, rel=0.01)
    assert plan.param_bytes == peak[_MemRefType.PARAM]


def test_dtensor_shape_propagation_on_global_fakes_is_not_this_ranks_memory() -> None:
    """DTensor runs each op once on global-size fake tensors to learn the output's shape; in
    a plan that happens in the plan's own fake mode, and must not count."""
    from torch.distributed.tensor import Shard, distribute_tensor

    from dream_trainer.configs import DeviceParameters
    from dream_trainer.planning.simulate import ShapesOnly
    from dream_trainer.world import DistributedWorld, LaunchEnvironment

    env = LaunchEnvironment(rank=5, world_size=1024, local_world_size=8, launched=True,
                            backend="fake")
    world = DistributedWorld(DeviceParameters(dp_shard="auto", device="cpu"), env)
    world.launch()
    try:
        assert world.mesh is not None
        with ShapesOnly().context():
            weight = distribute_tensor(torch.empty(4096, 4096), world.mesh, [Shard(0)])
            with StepMemory() as memory:
                doubled = weight * 2  # 64 MiB globally, 64 KiB on this rank
        assert doubled.to_local().untyped_storage().nbytes() == 4 * 4096 * 4
        assert memory.peak() == 4 * 4096 * 4
    finally:
        world.shutdown()
