"""A pipeline step for ``dream-trainer plan``: this rank's share of the schedule on fake tensors.

torch's schedules cannot run on the fake backend: a stage learns the shape of what it will
receive from its neighbour at the first step (a pickled message, which a fake process group
never delivers), and their sends are not seen by torch's comm debug mode. ``PlannedPipeline``
stands in for the trainer's ``PipelineRunner`` during a plan's step. It takes the order in
which the schedule runs this pipeline rank's actions (forwards, backwards, the split
backwards of the zero-bubble schedules, the gradient reductions) and runs them on this
rank's stages with torch's own stage methods, so FSDP sees the calls a real pipeline makes
(no gradient sync until the stage's last backward, then one reduce-scatter). What a stage
receives is a fake tensor of the boundary's shape, found once by running the unsplit model's
stages one after the other on the meta device; each send and receive is counted on the
``pp`` axis with its bytes.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from typing_extensions import override

from dream_trainer.configs.device import SINGLE_STAGE_SCHEDULES
from dream_trainer.parallel.dtensor import full_value
from dream_trainer.parallel.hf_pipeline import split_pipeline
from dream_trainer.parallel.pipeline_schedule import LossFn, PipelineRunner, split_microbatches
from dream_trainer.world.dims import MeshAxis

Record = Callable[[str, str, int], None]
"""``record(axis, kind, bytes)``: files one point-to-point message (``AxisCommMode.record``)."""

_AXIS = MeshAxis.PP.value


def boundary_shapes(reference: nn.Module, num_stages: int, inputs: tuple[Any, ...],
                    dtype: torch.dtype) -> dict[int, tuple[torch.Size, torch.dtype]]:
    """The shape and dtype of what each stage after the first receives, for one microbatch.

    The unsplit model (on the meta device, as ``configure_models`` built it) is split into all
    its stages, cast to the compute ``dtype``, and run stage after stage on ``inputs`` (meta
    tensors) under a fake tensor mode: nothing is allocated, and code that would read values
    treats the run as a trace (transformers' mask code then skips its checks of the position
    ids). The stages run without tensor parallelism, so a stage that passes on a sequence
    shard (sequence parallelism) is sized as the full sequence.
    """
    from torch._subclasses.fake_tensor import FakeTensorMode

    stages = split_pipeline(copy.deepcopy(reference), list(range(num_stages)), num_stages)
    shapes = {}
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        carried: Any = tuple(mode.from_tensor(value) if isinstance(value, torch.Tensor)
                             else value for value in inputs)
        for index, stage in enumerate(stages[:-1]):
            if dtype != torch.float32:
                stage.to(dtype)
            try:
                output = stage(*carried) if index == 0 else stage(carried)
            except (RuntimeError, NotImplementedError) as error:
                raise RuntimeError(
                    f"dream-trainer plan cannot size the activations between the pipeline "
                    f"stages of {type(reference).__name__}: its stage {index} does not run on "
                    f"fake tensors ({error}). This is a limit of the planner, not of the run "
                    "(the stage's code reads tensor values): plan it without "
                    "pipeline_parallel") from error
            if not isinstance(output, torch.Tensor):
                raise TypeError(f"pipeline stage {index} returned {type(output).__name__}: a "
                                "stage must return one tensor to pass on")
            shapes[index + 1] = (output.shape, output.dtype)
            carried = output
    return shapes


class BoundariesNeeded(Exception):
    """Raised by a ``PlannedPipeline`` without boundary shapes at its first microbatch: the
    plan sets the rank up again with ``shapes()``, found outside the step's dispatch modes
    (the unsplit model cannot run under them: their module hooks would count it)."""

    def __init__(self, reference: nn.Module, num_stages: int, inputs: tuple[Any, ...],
                 dtype: torch.dtype) -> None:
        super().__init__("the pipeline's boundary shapes are not known yet")
        self.reference, self.num_stages, self.dtype = reference, num_stages, dtype
        self.inputs = [(tuple(value.shape), value.dtype) if isinstance(value, torch.Tensor)
                       else value for value in inputs]

    def shapes(self) -> dict[int, tuple[torch.Size, torch.dtype]]:
        inputs = tuple(torch.empty(value[0], dtype=value[1], device="meta")
                       if isinstance(value, tuple) else value for value in self.inputs)
        return boundary_shapes(self.reference, self.num_stages, inputs, self.dtype)


class PlannedPipeline(PipelineRunner):
    """Runs this pipeline rank's actions of one schedule step on fake tensors, counting the
    messages a real run would send and receive.

    A runner of the same settings as the trainer's, on its process group; the plan puts it
    in the trainer's place with ``PipelineStages.swap_runner``.

    Args:
        runner: The trainer's runner (schedule, microbatches, stages, group).
        reference: The unsplit model on the meta device, for ``boundary_shapes``.
        dtype: The dtype stages compute in (``param_dtype``).
        record: Where each message is filed.
        boundaries: ``BoundariesNeeded.shapes()``; None raises ``BoundariesNeeded`` at the
            first microbatch.
    """

    def __init__(self, runner: PipelineRunner, reference: nn.Module, dtype: torch.dtype,
                 record: Record,
                 boundaries: dict[int, tuple[torch.Size, torch.dtype]] | None) -> None:
        super().__init__(runner.schedule_name, runner.microbatches, runner.stage_ids,
                         runner.num_stages, runner.pp_size, lambda: runner.group, runner.device)
        self.replaced = runner
        self.reference, self.dtype, self.record = reference, dtype, record
        self.boundaries = boundaries

    @override
    def teardown(self) -> None:
        super().teardown()
        self.replaced.teardown()  # the process group this runner uses is cached there

    @override
    def run(self, stages: Sequence[nn.Module], inputs: tuple[Any, ...], target: Any,
            loss_fn: LossFn, loss_scale: float | None, sum_losses: bool) -> torch.Tensor:
        if loss_scale is None:
            raise NotImplementedError("a plan runs a training step only")
        n = self.microbatches
        self.check_split(inputs, target)
        chunks = list(zip(*(split_microbatches(value, n) for value in inputs))) or [()] * n
        if self.boundaries is None:
            raise BoundariesNeeded(self.reference, self.num_stages, chunks[0], self.dtype)
        pipeline_stages = self.pipeline_stages(stages)
        if self.schedule_name in SINGLE_STAGE_SCHEDULES:
            order = _single_stage_order(self.schedule_name, self.stage_ids[0], self.num_stages,
                                        n)
        else:
            order = self.torch_schedule(pipeline_stages, loss_fn).pipeline_order[
                self.group.rank()]
        step = _Step(self, dict(zip(self.stage_ids, pipeline_stages)), chunks,
                     split_microbatches(target, n), loss_fn,
                     loss_scale if sum_losses else loss_scale / n)
        for action in order:
            if action is not None:
                step.act(action)
        return self.shared_loss(step.losses, sum_losses)


def _single_stage_order(schedule: str, stage: int, num_stages: int, n: int) -> list[Any]:
    """The order in which torch's GPipe and 1F1B run one stage's microbatches (their
    ``_step_microbatches``; the ``pipeline_order`` they publish is for display, and 1F1B's
    starts the last stage at the wrong microbatch in torch 2.13)."""
    from torch.distributed.pipelining.schedules import _Action
    from torch.distributed.pipelining.schedules import _ComputationType as Kind

    def forward(mb: int) -> Any:
        return _Action(stage, Kind.FORWARD, mb)

    def backward(mb: int) -> Any:
        return _Action(stage, Kind.FULL_BACKWARD, mb)

    if schedule == "GPipe":
        order = [forward(mb) for mb in range(n)] + [backward(mb) for mb in range(n)]
    else:  # 1F1B: the first stage warms up with num_stages forwards, the last with one
        warmup = min(n, num_stages - stage)
        order = [forward(mb) for mb in range(warmup)]
        for mb in range(n):
            order.append(backward(mb))
            if warmup + mb < n:
                order.append(forward(warmup + mb))
    return [*order, _Action(stage, Kind.REDUCE_GRAD, None)]


class _Step:
    """The state of one simulated step: each microbatch's inputs and outputs per stage."""

    def __init__(self, runner: PlannedPipeline, stages: dict[int, Any],
                 chunks: list[tuple[Any, ...]], targets: list[Any], loss_fn: LossFn,
                 scale: float) -> None:
        self.runner, self.stages, self.chunks, self.targets = runner, stages, chunks, targets
        self.loss_fn, self.scale = loss_fn, scale
        self.saved: dict[tuple[int, int], tuple[list[torch.Tensor], torch.Tensor]] = {}
        # What a stage passes to a neighbour on this rank (a V schedule's turn).
        self.activations: dict[tuple[int, int], torch.Tensor] = {}
        self.input_grads: dict[tuple[int, int], torch.Tensor] = {}
        self.weight_groups: dict[tuple[int, int], Any] = {}
        self.losses: list[torch.Tensor] = []
        self.last = runner.num_stages - 1

    def local(self, stage: int) -> bool:
        return stage in self.stages

    def act(self, action: Any) -> None:
        from torch.distributed.pipelining.schedules import _ComputationType as Kind

        kind, stage, mb = action.computation_type, action.stage_index, action.microbatch_index
        if kind == Kind.OVERLAP_F_B:
            for sub in action.sub_actions:
                self.act(sub)
        elif kind == Kind.FORWARD:
            self.forward(stage, mb)
        elif kind in (Kind.FULL_BACKWARD, Kind.BACKWARD_INPUT):
            self.backward(stage, mb, "full" if kind == Kind.FULL_BACKWARD else "input")
        elif kind == Kind.BACKWARD_WEIGHT:
            self.stages[stage].backward_maybe_with_nosync(
                "weight", {"param_groups": self.weight_groups.pop((stage, mb))})
        elif kind == Kind.REDUCE_GRAD:
            self.stages[stage].perform_reduce_grad(1)
        else:
            raise NotImplementedError(f"plan cannot simulate the pipeline action {action}")

    def forward(self, stage: int, mb: int) -> None:
        if stage == 0:
            args: tuple[Any, ...] = self.chunks[mb]
        elif self.local(stage - 1):
            args = (self.activations.pop((stage, mb)),)
        else:
            assert self.runner.boundaries is not None
            shape, dtype = self.runner.boundaries[stage]
            received = torch.empty(shape, dtype=dtype, device=self.runner.device)
            self.runner.record(_AXIS, "recv", _nbytes(received))
            args = (received.requires_grad_(True),)
        output = self.stages[stage].submod(*args)
        if stage == self.last:
            loss = self.loss_fn(output, self.targets[mb])
            self.losses.append(full_value(loss.detach()).float())
            output = loss * self.scale
        elif self.local(stage + 1):
            self.activations[(stage + 1, mb)] = output.detach().requires_grad_(True)
        else:
            self.runner.record(_AXIS, "send", _nbytes(output))
        inputs = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]
        self.saved[(stage, mb)] = (inputs, output)

    def backward(self, stage: int, mb: int, kind: str) -> None:
        inputs, output = self.saved.pop((stage, mb))
        if stage == self.last:
            grads = None
        elif self.local(stage + 1):
            grads = self.input_grads.pop((stage, mb))
        else:
            grads = torch.empty_like(output)
            self.runner.record(_AXIS, "recv", _nbytes(grads))
        input_grads, groups = self.stages[stage].backward_maybe_with_nosync(
            kind, {"stage_output": output, "output_grads": grads, "input_values": inputs})
        if kind == "input":
            self.weight_groups[(stage, mb)] = groups
        if stage == 0:
            return
        if self.local(stage - 1):
            self.input_grads[(stage - 1, mb)] = input_grads[0]
        else:
            self.runner.record(_AXIS, "send", _nbytes(input_grads[0]))


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()

