"""Pipeline parallelism: splitting a model into stages, and the module-like stage container.

The default split needs one model convention: ``forward`` skips any module that is None. A
rank's stage is the model itself (or a copy of it, for a rank with several stages) in which
the blocks of other stages, and the modules before or after the blocks that another stage
runs, are set to None. Every parameter therefore keeps its fully qualified name, and
``PipelineStages`` presents a rank's stages as one module with the original names, so
optimizers, ``step()`` and checkpoints see an ordinary model.

``torch.distributed.pipelining`` is imported where it is used (``parallel.pipeline_schedule``):
it pulls in FSDP and DTensor, which ``import dream_trainer`` must not load.
"""

from __future__ import annotations

import copy
import itertools
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from typing_extensions import override

from dream_trainer.configs.device import V_SCHEDULES
from dream_trainer.parallel.blocks import find_blocks
from dream_trainer.parallel.names import clean_name
from dream_trainer.world.dims import ParallelDims

if TYPE_CHECKING:
    from dream_trainer.parallel.pipeline_schedule import PipelineRunner

def stage_ids(pp_rank: int, dims: ParallelDims) -> list[int]:
    """The pipeline stages a pipeline rank holds, in increasing order.

    Stage ``s`` of ``p * v`` runs on pipeline rank ``s % p`` ("loop" placement), except for
    the V schedules (ZBVZeroBubble, DualPipeV), where rank ``r`` holds stages ``r`` and
    ``2p - 1 - r``, so the first and last stages share rank 0.

    Args:
        pp_rank: The rank in the pipeline (``pp_mesh.get_local_rank()``).
        dims: The resolved layout (``world.dims``): the degree ``pp``, the stages per rank
            and the schedule, as ``ParallelDims.resolve`` settled them.
    """
    if dims.pp_schedule in V_SCHEDULES:
        return [pp_rank, 2 * dims.pp - 1 - pp_rank]
    return [pp_rank + k * dims.pp for k in range(dims.pp_stages_per_rank)]


class _StageSequential(nn.Sequential):
    """``nn.Sequential`` whose forward skips the entries that other stages run (None)."""

    @override
    def forward(self, input: Any) -> Any:
        for module in self:
            if module is not None:
                input = module(input)
        return input


def split_model(model: nn.Module, stage_ids: Sequence[int], num_stages: int) -> list[nn.Module]:
    """Split ``model`` into pipeline stages and return the ones listed in ``stage_ids``.

    The blocks ``find_blocks`` finds are divided evenly into ``num_stages`` contiguous runs
    (earlier stages take one more when they do not divide); other entries of their container
    go with the block before them. Modules registered before the container (at every level
    above it) go to the first stage, modules after it to the last; parameters held directly
    by those levels go to the first stage; buffers stay on every stage. In each returned
    stage everything another stage runs is set to None, so names are unchanged. The model
    is used as the last returned stage and deep-copied for the others (cheap on the meta
    device). An ``nn.Sequential`` container is given a forward that skips None entries.

    Args:
        model: The model, usually still on the meta device.
        stage_ids: The stages to return.
        num_stages: The total number of stages.

    Returns:
        One module per entry of ``stage_ids``, in that order.

    A parameter shared by modules of different stages (an output layer tied to the
    embedding) becomes one copy per stage; ``PipelineStages.connect_ties`` finds them and
    ``PipelineStages.reduce_tied_gradients`` keeps the copies equal.

    Raises:
        ValueError: if the model has no blocks, blocks in more than one container, or fewer
            blocks than stages.
    """
    blocks = find_blocks(model)
    if not blocks:
        raise ValueError(
            f"{type(model).__name__} has no blocks to split into {num_stages} pipeline stages "
            "(find_blocks looks for a ModuleList or Sequential of modules with parameters): "
            "hold the repeated layers in an nn.ModuleList, or override "
            "apply_pipeline_parallel(pp_mesh)"
        )
    container = blocks[0][0]
    if any(other is not container for other, _, _ in blocks):
        raise ValueError(
            f"{type(model).__name__} holds blocks in more than one container; the default "
            "pipeline split needs them in one: override apply_pipeline_parallel(pp_mesh)"
        )
    if len(blocks) < num_stages:
        raise ValueError(
            f"{type(model).__name__} has {len(blocks)} blocks, too few for {num_stages} "
            "pipeline stages (pipeline_parallel x pipeline_stages_per_rank): use fewer stages"
        )
    path = path_to(model, container)
    owners = _entry_owners(container, [name for _, name, _ in blocks], num_stages)
    stages = []
    for position, stage in enumerate(stage_ids):
        part = model if position == len(stage_ids) - 1 else copy.deepcopy(model)
        _prune(part, path, owners, stage, num_stages)
        stages.append(part)
    return stages


def tied_names(model: nn.Module) -> list[list[str]]:
    """The names of each parameter that several places of ``model`` share, in
    ``named_parameters`` order (the first name is the one a one-process optimizer keys)."""
    names: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(clean_name(name))
    return [group for group in names.values() if len(group) > 1]


def path_to(root: nn.Module, target: nn.Module) -> list[str]:
    """Child names leading from ``root`` to ``target`` (empty when they are the same)."""
    for name, module in root.named_modules():
        if module is target:
            return name.split(".") if name else []
    raise ValueError("the blocks container is not a submodule of the model")


def _entry_owners(container: nn.Module, block_names: list[str], num_stages: int) -> dict[str, int]:
    """The stage of every entry of ``container``: blocks evenly, the rest with the block
    before them."""
    base, extra = divmod(len(block_names), num_stages)
    block_stage = {}
    blocks = iter(block_names)
    for stage in range(num_stages):
        for name in itertools.islice(blocks, base + (stage < extra)):
            block_stage[name] = stage
    owners, stage = {}, 0
    for name in container._modules:
        stage = block_stage.get(name, stage)
        owners[name] = stage
    return owners


def _prune(model: nn.Module, path: list[str], owners: dict[str, int], stage: int,
           num_stages: int) -> None:
    """Set to None, in place, everything of ``model`` that ``stage`` does not run."""
    node = model
    for depth in range(len(path) + 1):
        child = path[depth] if depth < len(path) else None
        if stage != 0:
            for name, param in list(node._parameters.items()):
                if param is not None:
                    setattr(node, name, None)
        if child is None:
            break
        names = list(node._modules)
        position = names.index(child)
        for index, name in enumerate(names):
            if (index < position and stage != 0) or (index > position and stage != num_stages - 1):
                setattr(node, name, None)
        node = node._modules[child]  # type: ignore[assignment]
    for name, owner in owners.items():
        if owner != stage:
            setattr(node, name, None)
    if type(node) is nn.Sequential:
        node.__class__ = _StageSequential


def _named(stage: nn.Module) -> Iterator[tuple[str, nn.Parameter]]:
    for name, param in stage.named_parameters(remove_duplicate=False):
        yield clean_name(name), param


def _like_parameter(param: nn.Parameter, local: torch.Tensor) -> torch.Tensor:
    """A gradient for ``param`` holding ``local`` (its shard, for a DTensor)."""
    from dream_trainer.parallel.dtensor import is_dtensor

    if not is_dtensor(param):
        return local.clone()
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(local.clone(), param.device_mesh,  # type: ignore[attr-defined]
                              param.placements, shape=param.shape,  # type: ignore[attr-defined]
                              stride=param.stride())


def _local(tensor: torch.Tensor) -> torch.Tensor:
    from dream_trainer.parallel.dtensor import local_tensor

    return local_tensor(tensor)


class PipelineStages(nn.Module):
    """This rank's pipeline stages, presented as one module with the model's own names.

    Under ``pipeline_parallel > 1`` the model attribute (``self.model``) holds this object:
    ``parameters()``, ``named_parameters()``, ``state_dict()``/``load_state_dict()`` (and so
    DCP's ``get_model_state_dict``), ``train()``/``eval()`` and attribute access
    (``self.model.layers``) behave as on the model, restricted to what this rank holds;
    modules of other ranks' stages are None. Calling it is an error: the trainer's
    ``forward_backward`` and ``forward_loss`` run the pipeline schedule.

    Args:
        stages: This rank's stage modules (as the parallelism hooks left them), in the
            order of ``stage_ids``.
        stage_ids: The stage index of each module.
        num_stages: The total number of stages.
        runner: What runs the schedule over these stages; None for a container that only
            holds them (``run`` is then an error).
        ties: The names of each parameter the whole model shares between several places
            (``tied_names``); ``connect_ties`` finds the ones different stages hold copies of.
    """

    def __init__(self, stages: Sequence[nn.Module], stage_ids: Sequence[int], num_stages: int,
                 runner: PipelineRunner | None = None,
                 ties: Sequence[Sequence[str]] = ()) -> None:
        super().__init__()
        # A plain list, not a ModuleList: the stages' modules are registered once, through
        # the merged tree, under their own names.
        self.stages = list(stages)
        self.stage_ids = list(stage_ids)
        self.num_stages = num_stages
        self.runner = runner
        self.ties = [list(group) for group in ties]
        # Per tied parameter held by several stages: this rank's copies, and the group of
        # the ranks holding copies (None when they are all here).
        self._tied_copies: list[tuple[list[nn.Parameter], Any]] = []
        self._uncounted: list[nn.Parameter] = []
        _merge_into(self, [unwrap_stage(stage) for stage in stages])

    def connect_ties(self, pp_group: Any | None) -> None:
        """Find the tied parameters that several stages hold a copy of, over the pipeline
        group (a collective on every pipeline rank; None when this process holds every
        stage), and make the process groups that sum their gradients. The copy of the lowest
        stage counts in the gradient norm.
        """
        import torch.distributed as dist

        tied = {name for group in self.ties for name in group}
        held = {stage_id: {name: param for name, param in _named(stage) if name in tied}
                for stage_id, stage in zip(self.stage_ids, self.stages)}
        mine = {stage_id: sorted(names) for stage_id, names in held.items()}
        views: list[Any] = [mine]
        ranks, me = [0], 0
        if pp_group is not None:
            views = [None] * dist.get_world_size(pp_group)
            dist.all_gather_object(views, mine, group=pp_group)
            ranks, me = dist.get_process_group_ranks(pp_group), dist.get_rank(pp_group)
        for group in self.ties:
            holders = {stage_id: rank for rank, view in enumerate(views)
                       for stage_id, names in view.items() if set(names) & set(group)}
            if len(holders) < 2:
                continue  # one stage runs every place of it: still one parameter there
            # This rank's copies, by stage; a stage holds one parameter for all its names.
            copies = [(stage_id, next(param for name, param in held[stage_id].items()
                                    if name in group))
                    for stage_id in sorted(holders) if stage_id in held]
            pp_ranks = sorted(set(holders.values()))
            process_group = None
            if len(pp_ranks) == len(ranks):
                process_group = pp_group
            elif len(pp_ranks) > 1 and me in pp_ranks:
                process_group = dist.new_group([ranks[rank] for rank in pp_ranks],
                                               use_local_synchronization=True)
            if copies:
                self._tied_copies.append(([param for _, param in copies], process_group))
                self._uncounted += [param for stage_id, param in copies
                                    if stage_id != min(holders)]

    def reduce_tied_gradients(self) -> None:
        """Give every copy of a parameter tied across stages the sum of the copies'
        gradients (what the one shared parameter of one process gets), before clipping and
        the step: the copies then stay equal."""
        import torch.distributed as dist

        for copies, process_group in self._tied_copies:
            if not any(param.requires_grad for param in copies):
                # Frozen (a LoRA base's tied embedding): nothing to share, and no gradient is
                # made for it. Every stage is split from one model, so all ranks skip alike.
                continue
            grads = [_local(param.grad) if param.grad is not None
                     else torch.zeros_like(_local(param)) for param in copies]
            total = grads[0].clone()
            for grad in grads[1:]:
                total += grad
            if process_group is not None:
                dist.all_reduce(total, group=process_group)
            for param, grad in zip(copies, grads):
                if param.grad is None:
                    param.grad = _like_parameter(param, total)
                else:
                    grad.copy_(total)

    @property
    def uncounted_parameters(self) -> list[nn.Parameter]:
        """The copies of tied parameters a gradient norm leaves out, so that it counts each
        once (another stage's copy counts)."""
        return list(self._uncounted)

    @property
    def has_first_stage(self) -> bool:
        """True on the rank that holds stage 0 (it is fed the inputs)."""
        return 0 in self.stage_ids

    @property
    def has_last_stage(self) -> bool:
        """True on the rank that holds the last stage (it computes the loss)."""
        return self.num_stages - 1 in self.stage_ids

    @override
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(
            "under pipeline_parallel > 1 the model runs stage by stage through the pipeline "
            "schedule: call self.forward_backward(self.model, *inputs, target=..., "
            "loss_fn=...) in training_step and self.forward_loss(...) in validation_step"
        )

    def run(self, inputs: tuple[Any, ...], target: Any, loss_fn: Any,
            loss_scale: float | None, sum_losses: bool) -> torch.Tensor:
        """Run one micro-batch through the schedule (see ``PipelineRunner.run``); the step
        API's ``forward_backward``/``forward_loss`` call it.

        Raises:
            RuntimeError: if the container has no runner.
        """
        if self.runner is None:
            raise RuntimeError("this PipelineStages was built without a runner: it holds "
                               "stages but cannot run a schedule")
        return self.runner.run(self.stages, inputs, target, loss_fn, loss_scale, sum_losses)

    def swap_runner(self, wrap: Callable[[PipelineRunner], PipelineRunner]) -> None:
        """Run the schedule through ``wrap(runner)`` from now on: the seam through which a
        tool substitutes its own runner (``dream-trainer plan`` simulates the step with one).

        Raises:
            RuntimeError: if the container has no runner.
        """
        if self.runner is None:
            raise RuntimeError("this PipelineStages was built without a runner: there is no "
                               "schedule runner to swap")
        self.runner = wrap(self.runner)

    def teardown(self) -> None:
        """Drop the schedules (their stages hold process groups), so none outlives ``fit()``."""
        if self.runner is not None:
            self.runner.teardown()

    @override
    def train(self, mode: bool = True) -> PipelineStages:
        super().train(mode)
        # The stage modules themselves (the model's class) are outside the merged tree.
        for stage in self.stages:
            stage.train(mode)
        return self

    @override
    def extra_repr(self) -> str:
        return f"stages={self.stage_ids} of {self.num_stages}"


def describe_stage(stage: nn.Module) -> str:
    """What a stage runs, in the model's names: ``"embed, layers.0-1"``."""
    parts = []
    for name, child in unwrap_stage(stage).named_children():
        if isinstance(child, (nn.ModuleList, nn.Sequential, nn.ModuleDict)):
            held = [key for key, entry in child._modules.items() if entry is not None]
            if held == list(child._modules):
                parts.append(name)
            elif held:
                numbered = all(key.isdigit() for key in held) and \
                    [int(key) for key in held] == list(range(int(held[0]), int(held[-1]) + 1))
                parts.append(f"{name}.{held[0]}-{held[-1]}" if numbered and len(held) > 1
                             else ", ".join(f"{name}.{key}" for key in held))
        else:
            parts.append(name)
    return ", ".join(parts) or "(nothing)"


def unwrap_stage(module: nn.Module) -> nn.Module:
    """The model-class module inside a torch.compile wrapper."""
    inner = getattr(module, "_orig_mod", None)
    return inner if isinstance(inner, nn.Module) else module


def _merge_into(target: nn.Module, nodes: list[nn.Module]) -> None:
    """Register on ``target`` the union of ``nodes``' children, parameters and buffers.

    ``nodes`` are the same place in several stages of one model: a child that one stage
    holds is shared as is, one that several hold (a container on the way to the blocks) is
    merged recursively, one that none holds is registered as None. A buffer several stages
    hold becomes one tensor, so loading a state dict updates every stage.
    """
    first = nodes[0]
    for name in first._modules:
        children = [node._modules[name] for node in nodes if node._modules.get(name) is not None]
        if len(children) > 1:
            merged = _empty_like(children[0])
            _merge_into(merged, children)  # type: ignore[arg-type]
            target.register_module(name, merged)
        else:
            target.register_module(name, children[0] if children else None)
    for name in first._parameters:
        held = [node._parameters[name] for node in nodes if node._parameters.get(name) is not None]
        target.register_parameter(name, held[0] if held else None)
    for name, buffer in first._buffers.items():
        persistent = name not in first._non_persistent_buffers_set
        target.register_buffer(name, buffer, persistent=persistent)
        for node in nodes[1:]:
            node.register_buffer(name, buffer, persistent=persistent)


def _empty_like(module: nn.Module) -> nn.Module:
    for kind in (nn.ModuleList, nn.ModuleDict, nn.Sequential):
        if isinstance(module, kind):
            return kind()
    return nn.Module()
