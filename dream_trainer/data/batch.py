"""Moving arbitrarily nested batches to a device."""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any, TypeVar

import torch

BatchT = TypeVar("BatchT")


def move_to_device(batch: BatchT, device: torch.device) -> BatchT:
    """Return ``batch`` with every tensor moved to ``device``, keeping the container types.

    Tensors, dicts (any ``dict`` subclass, e.g. ``defaultdict``), other mappings (returned as
    ``dict``), lists, tuples and namedtuples nest freely; any other object (strings, ints,
    ``None``) is returned as it is.
    """
    return _move(batch, device, device.type == "cuda")


def _move(obj: Any, device: torch.device, non_blocking: bool) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.to(device, non_blocking=non_blocking)
    if isinstance(obj, dict):
        # A shallow copy keeps the subclass and its extra state (a defaultdict's factory).
        moved = copy.copy(obj)
        for key, value in obj.items():
            moved[key] = _move(value, device, non_blocking)
        return moved
    if isinstance(obj, Mapping):
        return {key: _move(value, device, non_blocking) for key, value in obj.items()}
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return type(obj)(*(_move(value, device, non_blocking) for value in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(_move(value, device, non_blocking) for value in obj)
    return obj


def batch_size_of(batch: Any) -> int | None:
    """The number of samples in ``batch``: the first dimension of its first tensor (depth
    first, in order), or the length of its first list of plain values (strings, numbers).

    Returns:
        None when the batch holds neither (a custom object).
    """
    if isinstance(batch, torch.Tensor):
        return int(batch.shape[0]) if batch.dim() else 1
    if isinstance(batch, Mapping):
        values: list[Any] = list(batch.values())
    elif isinstance(batch, (list, tuple)):
        values = list(batch)
        if values and not any(isinstance(v, (torch.Tensor, Mapping, list, tuple))
                              for v in values):
            return len(values)  # one plain value per sample, as default_collate makes strings
    else:
        return None
    for value in values:
        size = batch_size_of(value)
        if size is not None:
            return size
    return None
