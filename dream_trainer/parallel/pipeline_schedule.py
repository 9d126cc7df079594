"""Running a ``torch.distributed.pipelining`` schedule over this rank's stages."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from dream_trainer.configs.device import SINGLE_STAGE_SCHEDULES, V_SCHEDULES
from dream_trainer.parallel.dtensor import full_value

LossFn = Callable[[Any, Any], torch.Tensor]
"""``loss_fn(output, target) -> loss``, called on the last stage once per microbatch."""

# Schedules kept per runner, for as many distinct (mode, input shapes): each first call
# re-infers shapes with an extra forward and backward, so batches alternating between a few
# shapes should not rebuild every time.
_KEPT_SCHEDULES = 4


class _LossSlot:
    """The loss function the schedules are built with, standing for the current call's.

    A schedule fixes its loss function at construction, while the step API takes one per
    call; this slot forwards to the current one and returns its loss multiplied by the
    gradient scale for backward, remembering the unscaled value of each loss it returned.
    """

    def __init__(self) -> None:
        self.loss_fn: LossFn | None = None
        self.scale = 1.0
        self._unscaled: dict[int, torch.Tensor] = {}

    def __call__(self, output: Any, target: Any) -> torch.Tensor:
        if self.loss_fn is None:
            raise RuntimeError("the pipeline ran its loss outside forward_backward/forward_loss")
        loss = self.loss_fn(output, target)
        scaled = loss * self.scale if self.scale != 1.0 else loss
        # Under loss_parallel the loss is a (replicated) DTensor.
        self._unscaled[id(scaled)] = full_value(loss.detach()).float()
        return scaled

    def unscaled(self, returned: list[torch.Tensor]) -> list[torch.Tensor]:
        """The unscaled values of the losses the schedule reports, and forget them all.

        A schedule's first call also runs the loss once to infer gradient shapes; only the
        losses it reports were part of the step.
        """
        values = [self._unscaled[id(loss)] for loss in returned]
        self._unscaled.clear()
        return values


class PipelineRunner:
    """Builds the configured schedule over this rank's stages and runs it.

    Schedules are built with ``scale_grads=False``: the default divides every gradient by
    the microbatch count at each ``step()``, which is right for one step per optimizer step
    but shrinks the gradients already accumulated over earlier micro-batches of a window
    (torchtitan#1732). Each microbatch's loss is scaled instead, so the accumulated gradient
    is that of one process on the whole window. A schedule is kept per training/evaluation
    mode and per input shapes (its receive buffers are sized by the first call).

    Args:
        schedule: The ``pipeline_schedule`` name.
        microbatches: Microbatches per call.
        stage_ids: The stages this rank holds.
        num_stages: The total number of stages.
        pp_size: The pipeline degree.
        pp_group: Returns the pipeline's process group. It is asked again after
            ``teardown()``: a run validated after ``fit()`` has a new process group.
        device: The device the stages run on.
    """

    def __init__(self, schedule: str, microbatches: int, stage_ids: Sequence[int],
                 num_stages: int, pp_size: int, pp_group: Callable[[], dist.ProcessGroup],
                 device: torch.device) -> None:
        self.schedule_name = schedule
        self.microbatches = microbatches
        self.stage_ids = list(stage_ids)
        self.num_stages = num_stages
        self.pp_size = pp_size
        # The last stage is on the last pipeline rank, or back on rank 0 for a V.
        self.last_stage_rank = 0 if schedule in V_SCHEDULES else pp_size - 1
        self.device = device
        self._pp_group = pp_group
        self._group: dist.ProcessGroup | None = None
        self._slot = _LossSlot()
        self._schedules: dict[tuple[Any, ...], Any] = {}
        self.microbatch_hook: Callable[[int], None] | None = None
        """Called with the index of the microbatch a stage runs next (packed documents
        switch their mask there); None when nothing needs it."""

    def run(self, stages: Sequence[nn.Module], inputs: tuple[Any, ...], target: Any,
            loss_fn: LossFn, loss_scale: float | None, sum_losses: bool) -> torch.Tensor:
        """Run one micro-batch through the pipeline; return its loss on every rank.

        Args:
            stages: This rank's stage modules, in the order of ``stage_ids``.
            inputs: The model's positional inputs (used on the first stage).
            target: The loss function's target (used on the last stage).
            loss_fn: ``loss_fn(output, target)``, called per microbatch.
            loss_scale: Backpropagate ``loss * loss_scale`` summed over the microbatches
                (divided by their count unless ``sum_losses``); None runs forward only.
            sum_losses: The microbatch losses are sums, to be added rather than averaged.

        Returns:
            The mean (or, with ``sum_losses``, the sum) of the microbatch losses, detached,
            broadcast from the last stage: a 0-dim float32 tensor on every rank.

        Raises:
            ValueError: if a tensor's first dimension does not split into the microbatches.
        """
        n = self.microbatches
        self.check_split(inputs, target)
        training = loss_scale is not None
        slot = self._slot
        slot.loss_fn = loss_fn
        slot.scale = 1.0 if loss_scale is None else (loss_scale if sum_losses else loss_scale / n)
        args = tuple(inputs) if 0 in self.stage_ids else ()
        has_last = self.num_stages - 1 in self.stage_ids
        returned: list[torch.Tensor] = []
        try:
            if not training and self.schedule_name in V_SCHEDULES:
                returned = self._forward_only(stages, inputs, target)
            else:
                schedule, fresh = self._schedule(stages, training, inputs, target)
                # A new schedule's first call infers shapes with a backward of its own, after
                # which torch clears FSDP gradients: keep those of earlier micro-batches.
                kept = _take_gradients(stages) if training and fresh else []
                run = schedule.step if training else schedule.eval
                run(*args, target=target if has_last else None, losses=returned,
                    return_outputs=False)
                _restore_gradients(kept)
        except TypeError as exc:
            if "'NoneType' object is not callable" in str(exc):
                raise TypeError(
                    f"a pipeline stage called a module that belongs to another stage ({exc}): "
                    "under pipeline_parallel the model's forward must skip modules that are "
                    "None (`if self.embed is not None: ...`, `for block in self.layers: if "
                    "block is not None: ...`), or apply_pipeline_parallel must be overridden"
                ) from exc
            raise
        finally:
            slot.loss_fn = None
        return self.shared_loss(slot.unscaled(returned), sum_losses)

    def shared_loss(self, losses: list[torch.Tensor], sum_losses: bool) -> torch.Tensor:
        """The mean (or sum) of the last stage's microbatch ``losses``, broadcast from it to
        every stage (the others pass an empty list)."""
        if self.num_stages - 1 in self.stage_ids:
            total = torch.stack(losses).sum()
            if not sum_losses:
                total = total / self.microbatches
        else:
            total = torch.zeros((), dtype=torch.float32, device=self.device)
        dist.broadcast(total, group=self.group, group_src=self.last_stage_rank)
        return total

    def _forward_only(self, stages: Sequence[nn.Module], inputs: tuple[Any, ...],
                      target: Any) -> list[torch.Tensor]:
        """Run each microbatch through the stages in order, forward only, with blocking sends.

        torch 2.13's ``eval()`` of the V schedules fails: when a rank holds two consecutive
        stages it asks the later one for input gradients that a forward-only run never made.
        Validation needs no overlap, so this plain pass replaces it there.
        """
        n = self.microbatches
        modules = dict(zip(self.stage_ids, stages))
        me = dist.get_rank(self.group)
        input_chunks = list(zip(*(split_microbatches(value, n) for value in inputs))) or [()] * n
        target_chunks = split_microbatches(target, n)
        losses = []
        for mb in range(n):
            self.entering(mb)
            carried: Any = None
            for stage in range(self.num_stages):
                if self._holder(stage) != me:
                    continue
                if stage == 0:
                    output = modules[stage](*input_chunks[mb])
                else:
                    if self._holder(stage - 1) != me:
                        carried = self._receive(self._holder(stage - 1))
                    output = modules[stage](carried)
                if stage == self.num_stages - 1:
                    losses.append(self._slot(output, target_chunks[mb]))
                elif self._holder(stage + 1) != me:
                    self._send(output, self._holder(stage + 1))
                carried = output
        return losses

    def entering(self, microbatch: int) -> None:
        """A stage is about to run ``microbatch`` (forward or backward)."""
        if self.microbatch_hook is not None:
            self.microbatch_hook(microbatch)

    def _holder(self, stage: int) -> int:
        """The pipeline rank that holds ``stage`` (V placement)."""
        degree = self.num_stages // 2
        return stage if stage < degree else self.num_stages - 1 - stage

    def _send(self, tensor: Any, peer: int) -> None:
        if type(tensor) is not torch.Tensor:
            raise TypeError(f"a pipeline stage must return one plain tensor to pass on, got "
                            f"{type(tensor).__name__}")
        dist.send_object_list([(tuple(tensor.shape), tensor.dtype)], group=self.group,
                              group_dst=peer, device=self.device)
        dist.send(tensor.contiguous(), group=self.group, group_dst=peer)

    def _receive(self, peer: int) -> torch.Tensor:
        header: list[Any] = [None]
        dist.recv_object_list(header, group=self.group, group_src=peer, device=self.device)
        shape, dtype = header[0]
        tensor = torch.empty(shape, dtype=dtype, device=self.device)
        dist.recv(tensor, group=self.group, group_src=peer)
        return tensor

    def from_last_stage(self, values: dict[str, float]) -> dict[str, float]:
        """``values`` as the ranks holding the last stage have them, on every stage."""
        box: list[Any] = [values]
        dist.broadcast_object_list(box, group=self.group, group_src=self.last_stage_rank,
                                   device=self.device)
        return dict(box[0])

    @property
    def group(self) -> dist.ProcessGroup:
        """The pipeline's process group (looked up once per process group)."""
        if self._group is None:
            self._group = self._pp_group()
        return self._group

    def teardown(self) -> None:
        """Drop the schedules (and their stages' references to modules and groups)."""
        self._schedules.clear()
        self._group = None

    def pipeline_stages(self, stages: Sequence[nn.Module]) -> list[Any]:
        """``stages`` wrapped in torch's ``PipelineStage``, on this runner's group."""
        from torch.distributed.pipelining import PipelineStage

        from dream_trainer.nn.moe import uncounted_load

        runner = self

        class Stage(PipelineStage):
            def _forward_metadata_inference(self, *args: Any, **kwargs: Any) -> Any:
                # A pass on the first microbatch (garbage after the first stage) that is not
                # part of the batch: MoE layers must not count its routing into their load.
                runner.entering(0)
                with uncounted_load():
                    return super()._forward_metadata_inference(*args, **kwargs)

            def forward_one_chunk(self, fwd_chunk_id: int, *args: Any, **kwargs: Any) -> Any:
                runner.entering(fwd_chunk_id)
                return super().forward_one_chunk(fwd_chunk_id, *args, **kwargs)

            def backward_one_chunk(self, bwd_chunk_id: int, *args: Any, **kwargs: Any) -> Any:
                runner.entering(bwd_chunk_id)  # activation checkpointing recomputes here
                return super().backward_one_chunk(bwd_chunk_id, *args, **kwargs)

        return [Stage(module, stage, self.num_stages, self.device, group=self.group)
                for module, stage in zip(stages, self.stage_ids)]

    def torch_schedule(self, pipeline_stages: list[Any], loss_fn: Callable[..., Any]) -> Any:
        """A new torch schedule of this kind over ``pipeline_stages``, with
        ``scale_grads=False``."""
        from torch.distributed.pipelining.schedules import get_schedule_class

        schedule_class = get_schedule_class(self.schedule_name)
        return schedule_class(
            pipeline_stages[0] if self.schedule_name in SINGLE_STAGE_SCHEDULES
            else pipeline_stages,
            n_microbatches=self.microbatches, loss_fn=loss_fn, scale_grads=False,
        )

    def check_split(self, inputs: tuple[Any, ...], target: Any) -> None:
        """Raise the ValueError of a batch that does not split into the microbatches."""
        n = self.microbatches
        for what, value in [*(("input", value) for value in inputs), ("target", target)]:
            if isinstance(value, torch.Tensor) and value.dim() and value.shape[0] % n:
                raise ValueError(
                    f"a pipeline {what} has {value.shape[0]} samples along dim 0, which do not "
                    f"split into pipeline_microbatches={n}: give every batch a multiple of {n} "
                    "samples (drop_last=True drops a short last batch)"
                )

    def _schedule(self, stages: Sequence[nn.Module], training: bool, inputs: tuple[Any, ...],
                  target: Any) -> tuple[Any, bool]:
        """The schedule for this mode and these shapes, and whether it was just built."""
        key = (training, _shapes(inputs), _shapes((target,)))
        if key in self._schedules:
            self._schedules[key] = self._schedules.pop(key)  # most recently used last
            return self._schedules[key], False
        schedule = self.torch_schedule(self.pipeline_stages(stages), self._slot)
        if len(self._schedules) >= _KEPT_SCHEDULES:
            del self._schedules[next(iter(self._schedules))]
        self._schedules[key] = schedule
        return schedule, True


def _shapes(values: tuple[Any, ...]) -> tuple[Any, ...]:
    return tuple((tuple(value.shape), value.dtype) if isinstance(value, torch.Tensor) else None
                 for value in values)


def split_microbatches(value: Any, n: int) -> list[Any]:
    """``n`` equal slices of a tensor along dim 0; anything else repeated ``n`` times."""
    if isinstance(value, torch.Tensor) and value.dim():
        return list(value.tensor_split(n))
    return [value] * n


def _take_gradients(stages: Sequence[nn.Module]) -> list[tuple[nn.Parameter, torch.Tensor]]:
    """Detach every existing gradient of ``stages`` from its parameter, to restore later."""
    kept = []
    for stage in stages:
        for param in stage.parameters():
            if param.grad is not None:
                kept.append((param, param.grad))
                param.grad = None
    return kept


def _restore_gradients(kept: list[tuple[nn.Parameter, torch.Tensor]]) -> None:
    """Add the gradients ``_take_gradients`` kept back onto what accumulated since."""
    for param, grad in kept:
        param.grad = grad if param.grad is None else param.grad + grad
