"""Measuring the activations a forward pass leaves for backward, whatever keeps them.

``torch.autograd.graph.saved_tensors_hooks`` sees every tensor autograd saves for backward,
except inside a region of ``torch.utils.checkpoint``: non-reentrant checkpointing installs
hooks of its own there (an inner pair of hooks replaces an outer one), keeps the region's
inputs in its own frame, and under a selective policy caches the outputs it keeps in its own
dispatch mode. So the hooks alone report the same bytes for "selective" as for "full".
``SavedActivations`` therefore counts, deduplicated by storage and without the parameters':
the storages the hooks saw, and every storage an operation created during forward that is
still alive once forward has returned (what the checkpoints keep, and what autograd saved).
Parameters and buffers are not activations: their storages (and their views') are left out.
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


def _key(tensor: torch.Tensor) -> int:
    """The identity of ``tensor``'s storage (its ``StorageImpl``), shared by its views."""
    return tensor.untyped_storage()._cdata


@dataclass(frozen=True)
class SavedBytes:
    hooks: int
    """Bytes of the distinct storages that ``saved_tensors_hooks`` packed (none of them
    inside a checkpointed region)."""
    held: int
    """Bytes of the distinct storages kept for backward: the hooks' and every storage that
    forward created and left alive (checkpoints' inputs and cached outputs included)."""


class _Created(TorchDispatchMode):
    """Records a weak reference to the storage of every tensor an operation returns."""

    def __init__(self) -> None:
        super().__init__()
        self.storages: dict[int, tuple[StorageWeakRef, int]] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for leaf in tree_leaves(out):
            if isinstance(leaf, torch.Tensor):
                storage = leaf.untyped_storage()
                # A storage freed during forward may give its address to a later one: the
                # later record replaces it, and is the one whose liveness counts.
                self.storages[storage._cdata] = (StorageWeakRef(storage), storage.nbytes())
        return out


def saved_activation_bytes(forward: Callable[[], torch.Tensor],
                           state: Iterable[torch.Tensor]) -> tuple[SavedBytes, torch.Tensor]:
    """Run ``forward`` (which returns the loss) and measure what it leaves for backward.

    Args:
        forward: One forward pass and its loss; nothing it returns but the loss may stay
            referenced, or it would count.
        state: The model's parameters and buffers, whose storages are not activations.

    Returns:
        The bytes kept, and the loss (whose own storage is not counted).
    """
    excluded = {_key(tensor) for tensor in state}
    hooked: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        if _key(tensor) not in excluded:
            hooked[_key(tensor)] = tensor.untyped_storage().nbytes()
        return tensor

    created = _Created()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor), created:
        loss = forward()
    gc.collect()
    excluded.add(_key(loss))
    alive = {key: size for key, (ref, size) in created.storages.items()
             if not ref.expired() and key not in excluded}
    hooks = sum(hooked.values())
    return SavedBytes(hooks, sum({**alive, **hooked}.values())), loss
