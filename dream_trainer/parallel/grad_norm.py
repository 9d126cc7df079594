"""Total gradient norm and clipping that hold for plain and DTensor parameters."""

from __future__ import annotations

from collections.abc import Collection, Hashable, Iterable

import torch
import torch.distributed as dist
from torch import nn

from dream_trainer.parallel.dtensor import is_dtensor


_PLAIN = {torch.Tensor}


def clip_grad_norm(parameters: Iterable[nn.Parameter], max_norm: float | None,
                   pipeline_group: dist.ProcessGroup | None = None,
                   uncounted: Collection[nn.Parameter] = ()) -> torch.Tensor:
    """Return the total 2-norm of the gradients, clipping them to ``max_norm`` if given.

    The norm is a 0-dim tensor on the gradients' device: nothing forces a host sync. DTensor
    gradients (FSDP2, TP) are grouped by mesh and placement, each group's norm is reduced over
    its mesh, and the groups combine with any plain gradients, so every rank gets the norm of
    the full gradient however the parameters are split.

    Args:
        parameters: This rank's parameters.
        max_norm: Clip the total norm to this value; None only measures it.
        pipeline_group: Under pipeline parallelism, the group of ranks holding the other
            stages: their squared norms are added (one all-reduce), so every stage measures
            and clips with the norm of the whole model.
        uncounted: Parameters clipped but left out of the norm: copies of a parameter tied
            across pipeline stages, which another stage's copy counts.
    """
    params = list(parameters)
    grads = [param.grad for param in params if param.grad is not None]
    # The gradients' distinct types, gathered at C speed: a Python call per gradient would
    # cost a small model's step more than the rest of this function.
    if not uncounted and (pipeline_group is None or dist.get_world_size(pipeline_group) == 1) \
            and set(map(type, grads)) <= _PLAIN:
        # Plain tensors, all counted (one process, DDP): torch's own norm and clip, and no
        # grouping, which at every step of a small model costs as much as the norm itself.
        # (Another tensor subclass takes the grouped path, which gives it the same norm.)
        if not grads:
            return torch.zeros((), device=params[0].device if params else None)
        total = torch.nn.utils.get_total_norm(grads, foreach=True)
        if max_norm is not None:
            torch.nn.utils.clip_grads_with_norm_(params, max_norm, total, foreach=True)
        return total
    groups: dict[Hashable, list[nn.Parameter]] = {}
    for param in params:
        grad = param.grad
        if grad is None:
            continue
        key = (grad.device_mesh, grad.placements) if is_dtensor(grad) else None
        groups.setdefault(key, []).append(param)
    device = params[0].device if params else None
    skip = {id(param) for param in uncounted}
    counted = [[param for param in group if id(param) not in skip] for group in groups.values()]
    norms = []
    for group in filter(None, counted):
        norm = torch.nn.utils.get_total_norm([p.grad for p in group], foreach=True)
        norms.append(norm.full_tensor() if is_dtensor(norm) else norm)
    if pipeline_group is not None and dist.get_world_size(pipeline_group) > 1:
        # Every stage takes part, one without gradients too: a collective needs all ranks.
        squares = torch.stack([n.to(device).float() ** 2 for n in norms]).sum() if norms \
            else torch.zeros((), device=device)
        dist.all_reduce(squares, group=pipeline_group)
        total = squares.sqrt()
    elif not norms:
        return torch.zeros((), device=device)
    else:
        total = norms[0] if len(norms) == 1 else \
            torch.linalg.vector_norm(torch.stack([n.to(norms[0].device) for n in norms]))
    if max_norm is not None:
        for group in groups.values():
            torch.nn.utils.clip_grads_with_norm_(group, max_norm, total, foreach=True)
    return total
