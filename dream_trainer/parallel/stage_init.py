"""Initializing a pipeline's stages with the weights one process would have: by replaying
the whole model's ``reset_parameters()`` block by block (``materialize_stages``), or by copying
them out of the whole model initialized once (``copy_into_stages``)."""

from __future__ import annotations

import itertools
import math
from collections.abc import Collection, Iterator, Sequence

import torch
from torch import nn

from dream_trainer.parallel.blocks import find_blocks
from dream_trainer.parallel.dtensor import local_tensor
from dream_trainer.parallel.materialize import FullTensorInit, reset_module
from dream_trainer.parallel.names import clean_name
from dream_trainer.parallel.pipeline import path_to


def materialize_stages(reference: nn.Module, stages: Sequence[nn.Module],
                       device: torch.device, skip: Collection[str] = ()) -> None:
    """Allocate ``stages`` on ``device`` and fill them with the values that initializing
    ``reference`` (the whole model, on the meta device) in one process would give.

    Every rank runs every module's ``reset_parameters()`` in ``modules()`` order, on one
    block-sized piece of ``reference`` at a time, and keeps the tensors its stages hold (its
    shard of them, for DTensors): the random generator advances as in a one-process run, so
    a pipeline starts from exactly the weights the same seed gives without one. Tensors no
    reset touched stay NaN for ``find_uninitialized`` to report, as do the parameters named
    in ``skip`` (pretrained weights will set them; their draws are skipped, as
    ``materialize`` skips them in one process). ``reference`` is consumed.
    """
    local = _allocate(stages, device)
    for prefix, unit, recurse in _units(reference):
        unit.to_empty(device=device, recurse=recurse)
        skipped = [tensor for name, tensor in unit.named_parameters(prefix, recurse=recurse)
                   if name in skip]
        with FullTensorInit(skip=skipped):
            for submodule in (unit.modules() if recurse else (unit,)):
                reset_module(submodule)
        tensors = itertools.chain(unit.named_parameters(prefix, recurse=recurse),
                                  unit.named_buffers(prefix, recurse=recurse))
        with torch.no_grad():
            for name, full in tensors:
                for target in local.get(name, ()):
                    _copy_full(target, full)
        unit.to_empty(device="meta", recurse=recurse)


def copy_into_stages(reference: nn.Module, stages: Sequence[nn.Module]) -> None:
    """Give ``stages`` (allocated) the values of ``reference``, the whole initialized model:
    each tensor they hold, or its shard for a DTensor, is copied from the tensor of the same
    name."""
    values = dict(itertools.chain(reference.named_parameters(remove_duplicate=False),
                                  reference.named_buffers(remove_duplicate=False)))
    with torch.no_grad():
        for stage in stages:
            named = itertools.chain(stage.named_parameters(remove_duplicate=False),
                                    stage.named_buffers(remove_duplicate=False))
            for name, tensor in named:
                _copy_full(tensor, values[clean_name(name)])


def _allocate(stages: Sequence[nn.Module], device: torch.device) -> dict[str, list[torch.Tensor]]:
    """Allocate ``stages`` on ``device``, floating tensors NaN; their tensors by clean name."""
    local: dict[str, list[torch.Tensor]] = {}
    for stage in stages:
        stage.to_empty(device=device)
        named = itertools.chain(stage.named_parameters(remove_duplicate=False),
                                stage.named_buffers(remove_duplicate=False))
        with torch.no_grad():
            for name, tensor in named:
                if tensor.is_floating_point():
                    local_tensor(tensor).fill_(math.nan)
                local.setdefault(clean_name(name), []).append(tensor)
    return local


def _units(reference: nn.Module) -> Iterator[tuple[str, nn.Module, bool]]:
    """``(prefix, module, recurse)`` covering ``reference.modules()`` in order: the modules
    above the blocks one by one, every other subtree (a block, an embedding) whole."""
    blocks = find_blocks(reference)
    above: set[int] = set()
    if blocks:
        path = path_to(reference, blocks[0][0])
        node = reference
        above.add(id(node))
        for name in path:
            node = node._modules[name]  # type: ignore[assignment]
            above.add(id(node))

    def walk(prefix: str, module: nn.Module) -> Iterator[tuple[str, nn.Module, bool]]:
        if id(module) not in above:
            yield prefix, module, True
            return
        yield prefix, module, False
        for name, child in module.named_children():
            yield from walk(f"{prefix}.{name}" if prefix else name, child)

    yield from walk("", reference)


def _copy_full(target: torch.Tensor, full: torch.Tensor) -> None:
    """Copy ``full`` into ``target``, or its local shard when ``target`` is a DTensor."""
    from dream_trainer.parallel.dtensor import is_dtensor

    if is_dtensor(target):
        from torch.distributed.tensor import distribute_tensor

        mesh, placements = target.device_mesh, target.placements  # type: ignore[attr-defined]
        shard = distribute_tensor(full, mesh, placements, src_data_rank=None)
        target.to_local().copy_(shard.to_local())  # type: ignore[attr-defined]
    else:
        target.copy_(full)
