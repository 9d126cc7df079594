"""Moving arbitrarily nested batches to a device."""

from __future__ import annotations

import copy
from collections.abc import Iterable, Mapping
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
        # A tensor already there is returned as it is: ``to`` would return it too, slower.
        return obj if obj.device == device else obj.to(device, non_blocking=non_blocking)
    if isinstance(obj, dict):
        # A shallow copy keeps the subclass and its extra state (a defaultdict's factory).
        moved = copy.copy(obj)
        for key, value in obj.items():
            moved[key] = _move(value, device, non_blocking)
        return moved
    if isinstance(obj, (list, tuple)):  # before the slower Mapping check: the usual batch
        moved = [_move(value, device, non_blocking) for value in obj]
        if type(obj) is not tuple and isinstance(obj, tuple) and hasattr(obj, "_fields"):
            return type(obj)(*moved)  # a namedtuple takes its fields as arguments
        return type(obj)(moved)
    if isinstance(obj, Mapping):
        return {key: _move(value, device, non_blocking) for key, value in obj.items()}
    return obj


def batch_size_of(batch: Any) -> int | None:
    """The number of samples in ``batch``: the first dimension of its first tensor (depth
    first, in order), or the length of its first list of plain values (strings, numbers).

    Returns:
        None when the batch holds neither (a custom object).
    """
    if isinstance(batch, torch.Tensor):
        return int(batch.shape[0]) if batch.dim() else 1
    if isinstance(batch, (list, tuple)):
        values: Iterable[Any] = batch
    elif isinstance(batch, Mapping):
        values = batch.values()
    else:
        return None
    nested = False
    for value in values:
        if isinstance(value, torch.Tensor):  # the usual first element: answered at once
            return int(value.shape[0]) if value.dim() else 1
        if isinstance(value, (Mapping, list, tuple)):
            nested = True
            size = batch_size_of(value)
            if size is not None:
                return size
    if not nested and isinstance(batch, (list, tuple)) and batch:
        return len(batch)  # one plain value per sample, as default_collate makes strings
    return None
