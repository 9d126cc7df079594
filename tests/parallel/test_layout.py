"""The layout strategy: resolved once from ``ParallelDims``; the loop and the mixins call it and
never ask which layout they are in; the pipeline's layout is resolved once and read from the
dims; an ``"auto"`` degree meets the rules a fixed one does."""

from __future__ import annotations

import ast
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from pydantic import ValidationError
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import dream_trainer
from dream_trainer.configs import DeviceParameters, TrainingParameters
from dream_trainer.data.loaders import prepare_loader
from dream_trainer.parallel.data_parallel import backend_for
from dream_trainer.parallel.layout import (ExpertParallel, Experts, Layout, PipelineLayout,
                                           pipelined_model)
from dream_trainer.parallel.pipeline import PipelineStages, stage_ids
from dream_trainer.world import DistributedWorld, LaunchEnvironment, ParallelDims
from tests.helpers.toy import ToyTrainer, toy_config

PACKAGE = Path(dream_trainer.__file__).parent

DEGREES = frozenset({"pp", "ep", "pipeline_parallel", "expert_parallel"})
"""Attributes that read a pipeline or expert degree, resolved (``dims.pp``) or configured."""


def layout_conditionals(tree: ast.Module) -> list[int]:
    """Lines that ask which layout the run is in: a degree read (``dims.pp > 1``), the
    pipeline's container named (``isinstance(model, PipelineStages)``) or its layout
    computed again (``pipeline_layout(...)``)."""
    lines = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and (node.attr in DEGREES
                                                or node.attr == "PipelineStages"):
            lines.add(node.lineno)
        elif isinstance(node, ast.Name) and node.id in ("PipelineStages", "pipeline_layout"):
            lines.add(node.lineno)
    return sorted(lines)


def found_in(*folders: str) -> dict[str, list[int]]:
    found = {}
    for folder in folders:
        for path in sorted((PACKAGE / folder).rglob("*.py")):
            lines = layout_conditionals(ast.parse(path.read_text()))
            if lines:
                found[str(path.relative_to(PACKAGE))] = lines
    return found


def world_of(params: DeviceParameters, world_size: int) -> DistributedWorld:
    """A world resolved for ``world_size`` ranks, not launched (no process group)."""
    return DistributedWorld(params, LaunchEnvironment(world_size=world_size))


def layout_of(params: DeviceParameters, world_size: int) -> Layout:
    world = world_of(params, world_size)
    return Layout.resolve(world, backend_for(world.dims))


# -- one strategy, resolved once ---------------------------------------------------------------
def test_the_loop_and_the_mixins_ask_no_layout_question() -> None:
    assert found_in("trainer", "mixins") == {}


def test_a_layout_question_is_found() -> None:
    planted = ast.parse(textwrap.dedent("""\
        def step(self, model):
            if self.world.dims.pp > 1:
                pass
            if isinstance(model, PipelineStages):
                pass
            per_rank, _ = pipeline_layout(params, 2)
            if dims.ep > 1 or params.expert_parallel != 1:
                pass
            if self.config.device_parameters.pipeline_parallel in (1, "auto"):
                pass
            self.layout.reduce_gradients(model)
            degrees = ("pipeline_parallel", "expert_parallel")
        """))
    assert layout_conditionals(planted) == [2, 4, 6, 7, 9]


def test_the_pipelines_layout_is_computed_by_the_config_and_the_dims_only() -> None:
    calls = sorted(str(path.relative_to(PACKAGE)) for path in PACKAGE.rglob("*.py")
                   for node in ast.walk(ast.parse(path.read_text()))
                   if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                   and node.func.id == "pipeline_layout")
    # The rules' check, the fixed degree's batch check (both configs), the run's resolution.
    assert calls == ["configs/device.py", "configs/device.py", "world/dims.py"]
    # The runner, the stage placement and the batch checks read the resolved dims.
    dims = ParallelDims.resolve(DeviceParameters(pipeline_parallel=2,
                                                 pipeline_schedule="Interleaved1F1B"), 4)
    assert (dims.pp, dims.dp_shard, dims.pp_stages_per_rank, dims.pp_microbatches,
            dims.pp_schedule) == (2, 2, 2, 4, "Interleaved1F1B")


@pytest.mark.parametrize(("params", "world_size", "kind", "experts"), [
    (DeviceParameters.SINGLE_DEVICE(), 1, Layout, Experts),
    (DeviceParameters.FSDP(), 4, Layout, Experts),
    (DeviceParameters(pipeline_parallel=2), 4, PipelineLayout, Experts),
    (DeviceParameters(pipeline_parallel="auto", dp_shard=1), 2, PipelineLayout, Experts),
    (DeviceParameters(expert_parallel=2), 4, Layout, ExpertParallel),
])
def test_the_layout_is_resolved_from_the_dims(params: DeviceParameters, world_size: int,
                                              kind: type, experts: type) -> None:
    layout = layout_of(params, world_size)
    assert type(layout) is kind and type(layout.experts) is experts


def test_a_trainer_holds_the_layout_of_its_world() -> None:
    trainer = ToyTrainer(toy_config())
    assert type(trainer.layout) is Layout and trainer.layout.world is trainer.world
    assert trainer.layout.data_parallel is trainer.data_parallel
    assert trainer.layout.stage_ids == [0]  # one stage: the whole model


def test_stage_ids_read_the_resolved_dims() -> None:
    # Three stages per rank on LoopedBFS: only the dims say so (the config's default is 2).
    dims = ParallelDims(pp=2, dp_replicate=1, dp_shard=1, cp=1, tp=1, pp_stages_per_rank=3,
                        pp_microbatches=6, pp_schedule="LoopedBFS")
    assert [stage_ids(rank, dims) for rank in range(2)] == [[0, 2, 4], [1, 3, 5]]
    v = ParallelDims.resolve(DeviceParameters(pipeline_parallel=4,
                                              pipeline_schedule="DualPipeV"), 4)
    assert [stage_ids(rank, v) for rank in range(4)] == [[0, 7], [1, 6], [2, 5], [3, 4]]


# -- the micro-batch run -----------------------------------------------------------------------
class RecordingRunner:
    """Stands in for the schedule: records what the layout hands it."""

    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []

    def run(self, stages: Any, inputs: tuple[Any, ...], target: Any, loss_fn: Any,
            loss_scale: float | None, sum_losses: bool) -> torch.Tensor:
        self.calls.append((inputs, target, loss_scale, sum_losses))
        return torch.tensor(2.5)


def test_one_process_runs_forward_then_the_trainers_backward() -> None:
    layout = layout_of(DeviceParameters.SINGLE_DEVICE(), 1)
    model = nn.Linear(3, 1)
    x, y = torch.ones(4, 3), torch.zeros(4, 1)
    backwards: list[torch.Tensor] = []

    def backward(loss: torch.Tensor) -> None:
        backwards.append(loss)
        loss.backward()

    def no_scale() -> float:
        raise AssertionError("the trainer's backward counts the items: no scale is asked")

    loss = layout.forward_backward(model, (x,), y, F.mse_loss, backward, no_scale, False)
    assert len(backwards) == 1 and backwards[0].requires_grad and not loss.requires_grad
    assert torch.equal(loss, F.mse_loss(model(x), y).detach())
    assert model.weight.grad is not None
    assert torch.equal(layout.forward_loss(model, (x,), y, F.mse_loss, False), loss)
    layout.check_backward()  # allowed


def test_a_pipeline_runs_the_schedule_with_the_counted_scale() -> None:
    layout = layout_of(DeviceParameters(pipeline_parallel=2), 2)
    runner = RecordingRunner()
    stages = PipelineStages([nn.Linear(2, 2)], [0], 2, runner)  # type: ignore[arg-type]
    scales = iter([0.25])
    x, y = torch.ones(4, 2), torch.zeros(4, 2)

    def backward(loss: torch.Tensor) -> None:
        raise AssertionError("the schedule runs backward itself")

    loss = layout.forward_backward(stages, (x,), y, F.mse_loss, backward, lambda: next(scales),
                                   True)
    assert loss.item() == 2.5
    layout.forward_loss(stages, (x,), y, F.mse_loss, False)
    assert [(call[2], call[3]) for call in runner.calls] == [(0.25, True), (None, False)]
    assert runner.calls[0][0] == (x,) and runner.calls[0][1] is y


def test_a_pipeline_refuses_what_its_schedule_does_itself() -> None:
    layout = layout_of(DeviceParameters(pipeline_parallel=2), 2)
    with pytest.raises(RuntimeError, match=r"backward\(\) cannot run under pipeline_parallel "
                                           r"> 1: .* self.forward_backward\(self.model, x"):
        layout.check_backward()
    with pytest.raises(RuntimeError, match="cannot run on one rank alone under "
                                           "pipeline_parallel > 1"):
        layout.local_pass([nn.Linear(2, 2)])
    with pytest.raises(TypeError, match="pass the model attribute itself .* not a Linear"):
        layout.forward_loss(nn.Linear(2, 2), (torch.ones(2, 2),), None, F.mse_loss, False)
    with pytest.raises(TypeError, match="not a Linear"):
        layout.reduce_gradients(nn.Linear(2, 2))
    with pytest.raises(ValueError, match=r"splits one model into stages, but configure_models "
                                         r"assigned 2: \['a', 'b'\]"):
        pipelined_model({"a": nn.Linear(1, 1), "b": nn.Linear(1, 1)})
    assert layout.teardown() is False  # nothing built yet


def test_teardown_drops_the_schedules_of_the_stages_it_built() -> None:
    layout = layout_of(DeviceParameters(pipeline_parallel=2), 2)
    assert isinstance(layout, PipelineLayout)

    class Runner(RecordingRunner):
        torn = 0

        def teardown(self) -> None:
            self.torn += 1

    runner = Runner()
    layout.stages = PipelineStages([nn.Linear(2, 2)], [0], 2, runner)  # type: ignore[arg-type]
    assert layout.teardown() is True and runner.torn == 1


# -- "auto" meets the rules a fixed degree does ------------------------------------------------
# (the degree rules themselves: tests/configs/test_configs.py, test_an_auto_degree_is_refused_...)
def test_an_auto_pipeline_is_refused_the_batch_a_fixed_one_is_with_the_same_message() -> None:
    with pytest.raises(ValidationError) as fixed:
        toy_config(train_batch_size=3,
                   device_parameters=DeviceParameters(pipeline_parallel=2, dp_shard=1))
    message = fixed.value.errors()[0]["msg"].removeprefix("Value error, ")
    assert message.startswith("training_parameters.train_batch_size=3 does not split into "
                              "device_parameters.pipeline_microbatches=2")
    auto = DeviceParameters(pipeline_parallel="auto", dp_shard=1)
    config = toy_config(train_batch_size=3, device_parameters=auto)  # cannot know the degree
    layout = layout_of(auto, 2)
    with pytest.raises(ValueError) as resolved:
        layout.check_batches(config.training_parameters, {})
    assert str(resolved.value) == message
    # A validation set whose last batch the microbatches cannot cut is refused by its name;
    # one process runs it whole.
    short = prepare_loader(DataLoader(TensorDataset(torch.zeros(5, 1)), batch_size=4), 1, 0, 0,
                           validation=True)
    params = TrainingParameters(n_epochs=1, train_batch_size=4)
    with pytest.raises(ValueError, match="the validation 'test' loader yields batches of 1, 4 "
                                         "samples"):
        layout.check_batches(params, {"validation 'test'": short})
    layout_of(DeviceParameters.SINGLE_DEVICE(), 1).check_batches(
        config.training_parameters, {"validation 'test'": short})


def test_the_layout_settings_cannot_change_after_it_was_resolved() -> None:
    trainer = ToyTrainer(toy_config())
    device = trainer.config.device_parameters
    for change in ({"pipeline_schedule": "GPipe"}, {"pipeline_microbatches": 4},
                   {"pipeline_stages_per_rank": 1}):
        other = trainer.config.model_copy(update={
            "device_parameters": device.model_copy(update=change)})
        with pytest.raises(ValueError, match=rf"cannot change the mesh \({next(iter(change))}\)"):
            trainer.replace_config(other)
