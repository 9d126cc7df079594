"""One simulated rank of ``dream-trainer plan``: the user's setup and one optimizer step on
torch's fake backend and fake tensors, measured."""

from __future__ import annotations

import copy
import functools
import gc
import itertools
import sys
import threading
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch._subclasses.fake_tensor import (DataDependentOutputException,
                                           DynamicOutputShapeException, FakeTensorMode,
                                           UnsupportedOperatorException)
from torch.utils._pytree import tree_leaves, tree_map_only
from typing_extensions import override

from dream_trainer.parallel.data_parallel import DDPBackend
from dream_trainer.parallel.pipeline import PipelineStages
from dream_trainer.planning.comms import AxisCommMode, group_axes
from dream_trainer.planning.memory import StepMemory, optimizer_tensors, storages
from dream_trainer.nn.moe import balanced_routing
from dream_trainer.planning.pipeline import BoundariesNeeded, PlannedPipeline
from dream_trainer.planning.report import RankPlan
from dream_trainer.planning.saved import at_first_backward
from dream_trainer.planning.session import (attach, sandboxed, set_up,
                                            without_callbacks_or_compilation)
from dream_trainer.trainer.base import BaseTrainer
from dream_trainer.trainer.callback import Callback
from dream_trainer.world.environment import LaunchEnvironment
from dream_trainer.world.materialization import Materialization


_DTENSOR_RANDOM_WARNING = "DTensor random operators may not have complete support"
"""The start of the warning torch 2.13 gives for every random op on a DTensor of a CPU mesh."""


class ShapesOnly(Materialization):
    """Fake tensors: shapes and dtypes without storage, so a rank of any size sets up on one
    CPU. The mode is made at first use, after the mesh: DeviceMesh computes its coordinates
    from real tensors."""

    has_values = False

    def __init__(self) -> None:
        self._mode: FakeTensorMode | None = None

    @property
    def mode(self) -> FakeTensorMode:
        if self._mode is None:
            self._mode = FakeTensorMode(allow_non_fake_inputs=True)
        return self._mode

    @override
    def context(self) -> FakeTensorMode:
        return self.mode


class _UnsplitModels(Callback[BaseTrainer]):
    """Keep a copy of each model as ``configure_models`` built it (on the meta device, so
    free), for ``PlannedPipeline`` to find the stage boundaries' shapes."""

    def __init__(self) -> None:
        self.models: dict[str, torch.nn.Module] = {}

    @override
    def post_configure(self) -> None:
        self.models = {name: copy.deepcopy(model)
                       for name, model in self.trainer.named_models().items()}


class _GradientProbe(Callback[BaseTrainer]):
    """Record the gradients each optimizer is about to consume (``step`` zeroes them)."""

    def __init__(self) -> None:
        self.memory: StepMemory | None = None
        self.grad_bytes: dict[Any, int] = {}
        self.allocations: set[int] = set()

    @override
    def pre_optimizer_step(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        grads = (param.grad for param in model.parameters() if param.grad is not None)
        for storage in storages(grads).values():
            allocation = self.memory.allocation_of(storage) if self.memory else None
            self.grad_bytes[allocation if allocation is not None else id(storage)] = \
                storage.nbytes()
            if allocation is not None:
                self.allocations.add(allocation)


def plan_rank(load: Callable[[], BaseTrainer], world_size: int, rank: int,
              nproc_per_node: int) -> RankPlan:
    """Build the trainer ``load`` returns as ``rank`` of ``world_size`` on the fake backend,
    set it up and run one optimizer step on fake tensors; measure what it held and sent.

    The config's callbacks are left out (their hooks may read tensor values, which fake
    tensors do not have) and compilation is off; checkpoints and logs go to a temporary
    directory, as for the other commands. Each rank runs in a thread of its own: DTensor
    keeps its sharding decisions in per-thread caches, and two ranks' meshes of the same
    shape compare equal, so a second rank on the same thread would reuse the first one's.

    Raises:
        NotImplementedError: for a layout the fake backend cannot run (DDP).
        Exception: whatever the trainer raised at this size (a mesh that does not fit, a
            shape that does not divide, a loader too small for the data-parallel degree).
    """
    env = LaunchEnvironment(rank=rank, local_rank=rank % nproc_per_node, world_size=world_size,
                            local_world_size=nproc_per_node, launched=True, backend="fake")
    outcome: list[RankPlan | BaseException] = []

    def run() -> None:
        boundaries = None
        try:
            while not outcome:
                with env.activate():
                    trainer = load()
                try:
                    outcome.append(_measure(trainer, boundaries))
                except BoundariesNeeded as needed:  # a pipeline: once, before its step
                    boundaries = needed.shapes()
        except BaseException as exc:  # re-raised on the caller's thread
            outcome.append(exc)

    # A daemon, so that an interrupt of the caller is not held up by a long step.
    thread = threading.Thread(target=run, name=f"plan rank {rank} of {world_size}", daemon=True)
    excepthook = sys.excepthook
    with warnings.catch_warnings():
        # Fake tensors hold no random values: whether DTensor's random ops are reproducible
        # on a CPU mesh is no concern of a plan, whose report the warning would interleave.
        warnings.filterwarnings("ignore", message=_DTENSOR_RANDOM_WARNING, category=UserWarning)
        thread.start()
        thread.join()
    # init_process_group wraps sys.excepthook in a "[rank<r>]" prefixer each time it runs.
    sys.excepthook = excepthook
    gc.collect()
    result = outcome[0]
    if isinstance(result, BaseException):
        raise result
    return result


def _measure(trainer: BaseTrainer,
             boundaries: dict[int, tuple[torch.Size, torch.dtype]] | None) -> RankPlan:
    device = trainer.config.device_parameters
    # No callbacks (their hooks may read values fake tensors do not have), and no compilation
    # (it would trace the fake step for nothing: the memory is the eager one's).
    without_callbacks_or_compilation(trainer)
    dims = trainer.world.dims
    if trainer.data_parallel.name == DDPBackend.name:
        raise NotImplementedError(
            f"plan cannot simulate DDP (dp_replicate={dims.dp_replicate} without dp_shard): "
            "DDP's C++ reducer needs real gradient buffers, which on one CPU would hold the "
            "whole model; plan the run with FSDP or HSDP (dp_shard > 1) instead"
        )
    probe = _GradientProbe()
    unsplit = _UnsplitModels()
    shapes = ShapesOnly()
    with sandboxed(trainer):
        attach(trainer, probe, *([unsplit] if dims.pp > 1 else []))
        with set_up(trainer, shapes):
            world = trainer.world
            batches, source = _window(trainer, shapes.mode)
            memory = StepMemory()
            probe.memory = memory
            comms = AxisCommMode(group_axes(world))
            for name, model in trainer.named_models().items():
                if isinstance(model, PipelineStages) and model.runner is not None:
                    model.swap_runner(functools.partial(
                        PlannedPipeline, reference=unsplit.models[name],
                        dtype=device.param_dtype, record=comms.record, boundaries=boundaries))
            # Fake tensors have no router choices: mixture-of-experts layers are planned with
            # every expert receiving an equal share of the tokens (the report says so).
            with shapes.mode, comms, memory, balanced_routing(), warnings.catch_warnings(), \
                    at_first_backward(trainer.named_models(), memory) as saved:
                # The comm mode's module hooks make torch warn about full backward hooks.
                warnings.filterwarnings("ignore", message="Full backward hook is firing")
                trainer.train_window(batches)
            models = trainer.named_models().values()
            params = storages(itertools.chain.from_iterable(
                itertools.chain(model.parameters(), model.buffers()) for model in models))
            state = storages(itertools.chain.from_iterable(
                optimizer_tensors(optimizer)
                for optimizer in trainer.named_optimizers().values()))
            excluded = probe.allocations | {memory.allocation_of(s) for s in state.values()}
            batch_bytes = max(_nbytes(batch) for batch in batches)
            return RankPlan(
                rank=world.rank,
                param_bytes=sum(s.nbytes() for s in params.values()),
                grad_bytes=sum(probe.grad_bytes.values()),
                optimizer_bytes=sum(s.nbytes() for s in state.values()),
                activation_bytes=memory.peak(excluded - {None}) + batch_bytes,
                saved=saved[0] if saved else None,
                collectives=dict(sorted(comms.traffic.items())),
                collective_kinds=dict(sorted(comms.kinds.items())),
                mesh={axis.value: size for axis, size in world.dims.mesh_axes()},
                steps_per_epoch=trainer.train_steps_per_epoch,
                micro_batches=len(batches),
                batch_source=source,
            )


def _window(trainer: BaseTrainer, fake_mode: FakeTensorMode) -> tuple[list[Any], str]:
    """One optimizer step's micro-batches as fake tensors: from ``plan_batch()`` if the trainer
    has one (called under the fake mode, so it may build batches of any size for free), else
    the first ones of this rank's train loader."""
    count = trainer.training_parameters.gradient_accumulation_steps
    plan_batch = getattr(trainer, "plan_batch", None)
    if callable(plan_batch):
        with fake_mode:
            batches = [plan_batch() for _ in range(count)]
        _check_rows(batches[0], trainer.training_parameters.train_batch_size)
        return batches, "plan_batch()"
    batches = list(itertools.islice(iter(trainer.train_dataloader), count))
    if len(batches) < count:
        raise ValueError(
            f"the train loader yielded {len(batches)} batches on this rank, fewer than the "
            f"gradient_accumulation_steps={count} of one optimizer step"
        )
    # Made fake here, so that the step's memory counts each micro-batch once, as a
    # plan_batch() one.
    return [tree_map_only(torch.Tensor, fake_mode.from_tensor, batch) for batch in batches], \
        "the train loader"


def _check_rows(batch: Any, batch_size: int) -> None:
    for tensor in tree_leaves(batch):
        if isinstance(tensor, torch.Tensor) and tensor.ndim and tensor.shape[0] != batch_size:
            raise ValueError(
                f"plan_batch() returned a tensor of shape {tuple(tensor.shape)}, whose first "
                f"dimension is not train_batch_size={batch_size}: return one micro-batch as "
                "the train loader would yield it on one rank"
            )


def _nbytes(batch: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tree_leaves(batch)
               if isinstance(t, torch.Tensor))


def describe_failure(exc: Exception, rank: int) -> str:
    """What the run would raise, or why the plan (not the run) cannot go on."""
    if isinstance(exc, (DataDependentOutputException, DynamicOutputShapeException)):
        return (f"rank {rank} cannot be planned: the trainer reads a tensor's values ({exc}: "
                ".item(), .tolist(), bool() of a tensor, or a shape computed from values), "
                "which the fake tensors of a plan do not have; skip that code when "
                "self.world.simulated is True")
    if isinstance(exc, UnsupportedOperatorException):
        return f"rank {rank} cannot be planned: {exc} has no fake-tensor implementation in torch"
    return f"rank {rank} would fail with {type(exc).__name__}: {exc}"
