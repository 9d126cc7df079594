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
