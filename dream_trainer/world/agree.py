"""Verdicts the ranks reach together: one collective, the same answer on every rank.

Without a process group, or in a group of one rank, each function answers from this rank's
own value and calls no collective, so code written for many ranks runs unchanged on one.
Every rank of the group must call the same function in the same order.
"""

from __future__ import annotations

from typing import TypeVar, cast

import torch
import torch.distributed as dist

T = TypeVar("T")


def is_launched() -> bool:
    """Whether this process belongs to a process group (``torch.distributed`` is set up)."""
    return dist.is_available() and dist.is_initialized()


def is_distributed(group: dist.ProcessGroup | None = None) -> bool:
    """Whether ``group`` (default: every rank) has peers to agree with: launched, and more
    than one rank in it."""
    return is_launched() and dist.get_world_size(group) > 1


def is_rank_zero() -> bool:
    """Whether this process is global rank 0, or runs without a process group."""
    return not is_launched() or dist.get_rank() == 0


def agree_any(flag: bool, device: torch.device,
              group: dist.ProcessGroup | None = None) -> bool:
    """True on every rank of ``group`` (default: all) when ``flag`` is True on any of them.

    Args:
        device: Where the collective runs (the rank's device: nccl reduces CUDA tensors only).
    """
    return bool(_reduce(int(flag), device, dist.ReduceOp.MAX, group))


def agree_max(value: int | torch.Tensor, device: torch.device,
              group: dist.ProcessGroup | None = None) -> int:
    """The largest ``value`` over the ranks of ``group`` (default: all).

    Args:
        value: An int, or an integer tensor of one element on ``device``: a verdict computed
            on the device is then read back to the host once, after the reduction.
        device: Where the collective runs.
    """
    return _reduce(value, device, dist.ReduceOp.MAX, group)


def agree_min(value: int | torch.Tensor, device: torch.device,
              group: dist.ProcessGroup | None = None) -> int:
    """The smallest ``value`` over the ranks of ``group`` (default: all); as ``agree_max``."""
    return _reduce(value, device, dist.ReduceOp.MIN, group)


def gather_objects(obj: T) -> list[T]:
    """Every rank's ``obj`` (picklable), in rank order; ``[obj]`` without peers."""
    if not is_distributed():
        return [obj]
    gathered: list[T | None] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, obj)
    return cast("list[T]", gathered)


def from_rank_zero(obj: T) -> T:
    """Rank 0's ``obj`` (picklable) on every rank: the verdict one rank reached for all."""
    if not is_distributed():
        return obj
    shared = [obj]
    dist.broadcast_object_list(shared, src=0)
    return shared[0]


def barrier(group: dist.ProcessGroup | None = None) -> None:
    """Return on every rank of ``group`` (default: all) once all have called it (at once
    without peers)."""
    if is_distributed(group):
        dist.barrier(group=group)


def _reduce(value: int | torch.Tensor, device: torch.device, op: dist.ReduceOp,
            group: dist.ProcessGroup | None) -> int:
    if not is_distributed(group):
        return int(value)
    # gloo cannot all-reduce bool, so int64; a copy, so that a caller's tensor stays its own.
    tensor = torch.as_tensor(value, device=device).to(torch.int64, copy=True).reshape(1)
    dist.all_reduce(tensor, op=op, group=group)
    return int(tensor.item())
