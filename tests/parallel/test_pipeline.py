"""The pipeline split, stage container and materialization, without a process group."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from dream_trainer.configs import DeviceParameters
from dream_trainer.data.loaders import pipeline_split_problem, prepare_loader
from dream_trainer.parallel.grad_norm import clip_grad_norm
from dream_trainer.parallel.materialize import materialize
from dream_trainer.parallel.pipeline import (PipelineStages, describe_stage, split_model,
                                             stage_ids, tied_names)
from dream_trainer.parallel.pipeline_schedule import PipelineRunner
from dream_trainer.parallel.stage_init import materialize_stages
from dream_trainer.world.dims import ParallelDims
from tests.helpers.toy import ToyTrainer, toy_config
from tests.helpers.transformer import TinyTransformer


def held(stage: nn.Module) -> list[str]:
    return [name for name, _ in stage.named_parameters()]


def meta_transformer(layers: int) -> nn.Module:
    with torch.device("meta"):
        return TinyTransformer(layers)


@pytest.mark.parametrize(("schedule", "size", "rank", "expected"), [
    ("1F1B", 2, 1, [1]),
    ("Interleaved1F1B", 2, 0, [0, 2]),  # loop placement: stage s on rank s % 2
    ("LoopedBFS", 4, 3, [3, 7]),
    ("ZBVZeroBubble", 2, 0, [0, 3]),  # V placement: first and last stage on rank 0
    ("DualPipeV", 4, 1, [1, 6]),
])
def test_stage_ids_follow_the_schedules_placement(schedule: str, size: int, rank: int,
                                                  expected: list[int]) -> None:
    params = DeviceParameters(pipeline_parallel=size, pipeline_schedule=schedule)
    assert stage_ids(rank, ParallelDims.resolve(params, world_size=size)) == expected


def test_the_default_split_keeps_every_name_and_sets_other_stages_to_none() -> None:
    full = meta_transformer(4)
    names = held(full)
    first, last = split_model(meta_transformer(4), [0, 1], 2)
    assert first.head is None and first.norm is None and last.embed is None
    assert [block is None for block in first.layers] == [False, False, True, True]
    assert [block is None for block in last.layers] == [True, True, False, False]
    assert held(first) + held(last) == names  # nothing lost, nothing renamed
    assert describe_stage(first) == "embed, layers.0-1"
    assert describe_stage(last) == "layers.2-3, norm, head"


def test_blocks_that_do_not_divide_go_to_the_earlier_stages() -> None:
    stages = split_model(meta_transformer(5), [0, 1, 2, 3], 4)
    assert [describe_stage(stage) for stage in stages] == [
        "embed, layers.0-1", "layers.2", "layers.3", "layers.4, norm, head"]


def test_a_v_rank_gets_a_copy_per_stage() -> None:
    model = meta_transformer(4)
    first, last = split_model(model, [0, 3], 4)
    assert last is model and first is not model  # copies only for the extra stages
    assert describe_stage(first) == "embed, layers.0"
    assert describe_stage(last) == "layers.3, norm, head"


def test_a_sequential_model_splits_at_its_blocks_and_skips_other_stages() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Dropout(0.0), nn.Linear(8, 2))
    reference = copy.deepcopy(model)
    first, last = split_model(model, [0, 1], 2)
    assert [entry is None for entry in first] == [False, False, False, True]
    assert [entry is None for entry in last] == [True, True, True, False]
    x = torch.randn(3, 4)
    # Each stage's forward runs only its own entries; together they are the model.
    torch.testing.assert_close(last(first(x)), reference(x), rtol=0, atol=0)


class TwoStacks(nn.Module):
    """Blocks in two containers side by side (a ModuleDict of them would itself be the one
    container, its stacks the blocks)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.ModuleList([nn.Linear(2, 2)] * 2)
        self.b = nn.ModuleList([nn.Linear(2, 2)] * 2)


@pytest.mark.parametrize(("model", "stages", "message"), [
    (nn.Linear(2, 2), 2, "has no blocks to split into 2 pipeline stages"),
    (TinyTransformer(2), 4, "has 2 blocks, too few for 4 pipeline stages"),
    (TwoStacks(), 2, "holds blocks in more than one container"),
])
def test_models_the_default_split_cannot_handle_say_to_override(
        model: nn.Module, stages: int, message: str) -> None:
    with pytest.raises(ValueError, match=message) as info:
        split_model(model, [0], stages)
    assert "apply_pipeline_parallel" in str(info.value) or "fewer stages" in str(info.value)


def test_a_weight_tied_across_stages_becomes_one_copy_per_stage_summed_before_the_step() -> None:
    tied = meta_transformer(4)
    tied.head.weight = tied.embed.weight  # (32, 16) both: the output layer tied to the input
    assert tied_names(tied) == [["embed.weight", "head.weight"]]
    first, last = split_model(tied, [0, 1], 2)
    assert first.embed.weight is not last.head.weight  # a copy on each stage
    for stage in (first, last):
        stage.to_empty(device="cpu")
    # One process holding both stages (as rank 0 of a V schedule does): the copies' sum.
    stages = PipelineStages([first, last], [0, 1], 2, ties=[["embed.weight", "head.weight"]])
    stages.connect_ties(None)
    first.embed.weight.grad = torch.full((32, 16), 1.0)
    last.head.weight.grad = torch.full((32, 16), 2.0)
    stages.reduce_tied_gradients()
    assert torch.equal(first.embed.weight.grad, torch.full((32, 16), 3.0))
    assert torch.equal(last.head.weight.grad, torch.full((32, 16), 3.0))
    # The norm counts the first stage's copy only: sqrt(32 * 16 * 9), not twice that square.
    assert stages.uncounted_parameters == [last.head.weight]
    for param in stages.parameters():
        if param.grad is None:
            param.grad = torch.zeros_like(param)
    norm = clip_grad_norm(stages.parameters(), None, uncounted=stages.uncounted_parameters)
    assert float(norm) == pytest.approx((32 * 16 * 9) ** 0.5)

    within = meta_transformer(4)
    within.layers[1].q.weight = within.layers[0].q.weight  # both blocks on stage 0 of 2
    first, _ = split_model(within, [0, 1], 2)
    assert first.layers[0].q.weight is first.layers[1].q.weight


def test_materialized_stages_hold_the_one_process_weights() -> None:
    torch.manual_seed(7)
    whole = meta_transformer(4)
    materialize(whole, torch.device("cpu"))
    after_whole = torch.rand(3)
    torch.manual_seed(7)
    reference = meta_transformer(4)
    stages = split_model(copy.deepcopy(reference), [0, 1], 2)
    materialize_stages(reference, stages, torch.device("cpu"))
    after_stages = torch.rand(3)
    container = PipelineStages(stages, [0, 1], 2)
    expected = dict(whole.named_parameters())
    assert dict(container.named_parameters()).keys() == expected.keys()
    for name, param in container.named_parameters():
        assert torch.equal(param, expected[name]), name
    # The generator advanced as in one process, so init_weights() draws the same numbers.
    assert torch.equal(after_stages, after_whole)


def test_the_container_is_the_model_to_optimizers_state_dicts_and_modes() -> None:
    model = TinyTransformer(4)
    model.register_buffer("scale", torch.ones(2))  # a root buffer every stage keeps
    state = model.state_dict()
    stages = split_model(copy.deepcopy(model), [0, 1], 2)
    container = PipelineStages(stages, [0, 1], 2)
    assert list(container.state_dict()) == list(state)
    assert container.has_first_stage and container.has_last_stage
    assert container.layers[2] is stages[1].layers[2] and container.head is stages[1].head
    # Loading reaches every stage, the buffer both stages hold included.
    container.load_state_dict({key: torch.zeros_like(value) for key, value in state.items()})
    assert all(not param.any() for stage in stages for param in stage.parameters())
    assert not stages[0].scale.any() and not stages[1].scale.any()
    container.eval()
    assert not any(module.training for stage in stages for module in stage.modules())
    with pytest.raises(RuntimeError, match="self.forward_backward"):
        container(torch.zeros(1, 8, dtype=torch.long))


def test_a_batch_that_does_not_split_into_the_microbatches_is_refused() -> None:
    runner = PipelineRunner("1F1B", 2, [0], 2, 2, lambda: None, torch.device("cpu"))
    with pytest.raises(ValueError, match="has 3 samples along dim 0, which do not split into "
                                         "pipeline_microbatches=2"):
        runner.run([nn.Linear(2, 2)], (torch.zeros(3, 2),), torch.zeros(3, 2), F.mse_loss,
                   1.0, False)


class StepAPIToy(ToyTrainer):
    def training_step(self, batch: Any, batch_idx: int) -> dict[str, Any]:
        x, y = batch
        loss = self.forward_backward(self.model, x, target=y, loss_fn=F.mse_loss)
        if not self.is_accumulating_gradients:
            return {"loss": loss, "grad_norm": self.step(self.model, self.optimizer)}
        return {"loss": loss}


def test_without_a_pipeline_forward_backward_is_loss_then_backward() -> None:
    config = toy_config(gradient_accumulation_steps=2, max_steps=3)
    plain, step_api = ToyTrainer(config), StepAPIToy(config)
    plain.fit()
    step_api.fit()
    for (name, expected), (_, actual) in zip(plain.model.named_parameters(),
                                             step_api.model.named_parameters(), strict=True):
        assert torch.equal(actual, expected), name
    with pytest.raises(RuntimeError, match="only be called inside training_step"):
        step_api.forward_backward(step_api.model, torch.zeros(1, 8), target=torch.zeros(1, 4),
                                  loss_fn=F.mse_loss)
    value = step_api.forward_loss(step_api.model, torch.zeros(1, 8), target=torch.zeros(1, 4),
                                  loss_fn=F.mse_loss)
    assert value.shape == () and not value.requires_grad


def validation_loader(samples: int, batch_size: int, ranks: int, rank: int = 0,
                      drop_last: bool = False) -> Any:
    """A validation loader split over ``ranks`` data-parallel ranks, as setup splits it."""
    data = TensorDataset(torch.zeros(samples, 2))
    return prepare_loader(DataLoader(data, batch_size=batch_size, drop_last=drop_last), ranks,
                          rank, seed=0, validation=True)


@pytest.mark.parametrize(("loader", "microbatches", "max_batches", "message"), [
    # 10 samples over 4 ranks: 3, 3, 2 and 2 each, so batches of 2 and 1.
    (validation_loader(10, 2, 4), 2, None,
     "the validation loader yields batches of 1, 2 samples (batch_size=2, 10 samples over 4 "
     "data-parallel ranks), and a pipeline cuts every batch into pipeline_microbatches=2 equal "
     "slices, so its batches of 1 samples cannot run: give the set a multiple of 8 samples "
     "(batch_size x 4 data-parallel ranks), so that every rank reads full batches"),
    # One rank: drop_last=True leaves out the short last batch.
    (validation_loader(10, 4, 1), 4, None,
     "the validation loader yields batches of 2, 4 samples (batch_size=4, 10 samples over 1 "
     "data-parallel rank), and a pipeline cuts every batch into pipeline_microbatches=4 equal "
     "slices, so its batches of 2 samples cannot run: build it with drop_last=True (which "
     "leaves out the last 2 samples of the set)"),
    (validation_loader(12, 3, 1), 2, None,
     "the validation loader yields batches of 3 samples (batch_size=3, 12 samples over 1 "
     "data-parallel rank), and a pipeline cuts every batch into pipeline_microbatches=2 equal "
     "slices, so its batches of 3 samples cannot run: give the loader a batch_size that is a "
     "multiple of 2"),
    (validation_loader(10, 4, 1), 4, 2, None),  # val_steps_per_epoch=2: the short one is unread
    (validation_loader(10, 4, 1, drop_last=True), 4, None, None),
    (validation_loader(16, 2, 4), 2, None, None),
    (DataLoader(TensorDataset(torch.zeros(10, 2)), batch_size=4), 4, None, None),  # unsplit
])
def test_a_validation_batch_the_pipeline_cannot_cut_is_named_before_it_is_read(
        loader: Any, microbatches: int, max_batches: int | None, message: str | None) -> None:
    assert pipeline_split_problem(loader, "validation", microbatches, max_batches) == message


def test_the_batch_sizes_named_are_those_each_rank_reads() -> None:
    for rank in range(4):
        loader = validation_loader(10, 2, 4, rank)
        assert [len(batch[0]) for batch in loader] == loader.batch_sampler.batch_sizes(rank)


def test_a_custom_collate_is_left_to_the_check_of_each_batch() -> None:
    # A collate function may pack or pad rows, so the sample count need not be the batch's
    # first dimension: only reading the batch tells.
    loader = DataLoader(TensorDataset(torch.zeros(10, 2)), batch_size=4,
                        collate_fn=lambda rows: torch.stack([row[0] for row in rows]))
    split = prepare_loader(loader, 1, 0, seed=0, validation=True)
    assert pipeline_split_problem(split, "validation", 4) is None
    assert pipeline_split_problem(validation_loader(10, 4, 1), "validation", 4) is not None


def test_swap_runner_puts_a_runner_in_the_containers_place() -> None:
    class Recording(PipelineRunner):
        def __init__(self, replaced: PipelineRunner) -> None:
            super().__init__(replaced.schedule_name, replaced.microbatches, replaced.stage_ids,
                             replaced.num_stages, replaced.pp_size, lambda: None,
                             replaced.device)
            self.replaced, self.calls = replaced, 0

        def run(self, *args: Any) -> torch.Tensor:
            self.calls += 1
            return torch.tensor(2.0)

    original = PipelineRunner("1F1B", 2, [0], 2, 2, lambda: None, torch.device("cpu"))
    container = PipelineStages([nn.Linear(2, 2)], [0], 2, original)
    container.swap_runner(Recording)
    assert isinstance(container.runner, Recording) and container.runner.replaced is original
    assert container.run((torch.zeros(2, 2),), None, F.mse_loss, 1.0, False).item() == 2.0
    assert container.runner.calls == 1
    with pytest.raises(RuntimeError, match="built without a runner: there is no schedule"):
        PipelineStages([nn.Linear(2, 2)], [0], 2).swap_runner(Recording)
