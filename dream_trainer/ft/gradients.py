"""Reducing gradients across replica groups through a torchft ``Manager``.

Each rank reduces its own gradients (the local shards of FSDP2 or tensor-parallel DTensors)
with the rank of the same index in every other live group: the groups have one topology, so
those hold the same shards. The gradients of one dtype and device are flattened into buckets
of at most ``bucket_bytes`` and reduced concurrently, one collective per bucket.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
from torch import nn

from dream_trainer.parallel.dtensor import local_tensor

if TYPE_CHECKING:
    from torchft import Manager


def reduce_gradients(manager: Manager, parameters: Sequence[nn.Parameter], *, summed: bool,
                     bucket_bytes: int, device: torch.device) -> None:
    """Average (or, with ``summed``, add up) the gradients of ``parameters`` over the live
    replica groups, in place.

    A parameter without a gradient on this rank takes part with zeros, so every group reduces
    the same buckets; it gets the reduced gradient only if some group had one (a parameter no
    group used keeps ``grad=None``, which optimizers skip). If a collective fails the manager
    records the error and the step will not commit, so the gradients are left as they are.

    Args:
        manager: The torchft manager, with this step's quorum started.
        parameters: The trainable parameters, in the same order in every group.
        summed: Add the groups' gradients instead of averaging them.
        bucket_bytes: Largest bucket to reduce in one collective.
        device: The device of the cross-group collectives' small bookkeeping tensor.
    """
    from torch.distributed import ReduceOp

    grads = [_local_grad(param) for param in parameters]
    present = torch.tensor([0.0 if p.grad is None else 1.0 for p in parameters], device=device)
    works = [manager.allreduce(present, reduce_op=ReduceOp.SUM)]
    buckets = _buckets(grads, bucket_bytes)
    flats = [torch.cat([grads[i].reshape(-1) for i in bucket]) for bucket in buckets]
    op = ReduceOp.SUM if summed else ReduceOp.AVG
    works += [manager.allreduce(flat, reduce_op=op) for flat in flats]
    for work in works:
        work.wait()
    if manager.errored() is not None:
        return
    used = present.tolist()
    with torch.no_grad():
        for bucket, flat in zip(buckets, flats):
            offset = 0
            for i in bucket:
                size = grads[i].numel()
                param = parameters[i]
                if used[i] > 0:
                    if param.grad is None:
                        param.grad = torch.zeros_like(param.detach())
                    local_tensor(param.grad).copy_(flat[offset:offset + size].view_as(grads[i]))
                offset += size


def _buckets(grads: Sequence[torch.Tensor], bucket_bytes: int) -> list[list[int]]:
    """Indices of consecutive gradients of one dtype and device, at most ``bucket_bytes`` per
    bucket (a larger gradient gets a bucket of its own)."""
    buckets: list[list[int]] = []
    size = 0
    for index, grad in enumerate(grads):
        nbytes = grad.numel() * grad.element_size()
        first = grads[buckets[-1][0]] if buckets else None
        if first is None or size + nbytes > bucket_bytes or first.dtype != grad.dtype \
                or first.device != grad.device:
            buckets.append([index])
            size = nbytes
        else:
            buckets[-1].append(index)
            size += nbytes
    return buckets


def _local_grad(param: nn.Parameter) -> torch.Tensor:
    """This rank's gradient of ``param``, or zeros of its local shape when it has none."""
    if param.grad is not None:
        return local_tensor(param.grad)
    return torch.zeros_like(local_tensor(param.detach()))
