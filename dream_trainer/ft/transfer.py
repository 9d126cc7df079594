"""The trainer state a recovering replica group copies from a live peer, in a form that can
cross the wire (``wire`` turns it into bytes).

A ``DTensor`` cannot cross into another process as it is (its mesh holds process groups).
Each DTensor travels as its local shard plus its layout (``Sharded``); the peer rank that
receives it holds the same shard of the same layout, because every group has the same
topology, and rebuilds the DTensor on its own mesh.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from dream_trainer.parallel.dtensor import is_dtensor, local_tensor

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh


@dataclass(frozen=True)
class Sharded:
    """A DTensor on the wire: this rank's shard and how it lies on which mesh dimensions."""

    local: torch.Tensor
    placements: tuple[Any, ...]
    shape: torch.Size
    stride: tuple[int, ...]
    mesh_dims: tuple[str, ...]
    on_accelerator: bool


def to_wire(tree: Any) -> Any:
    """``tree`` (dicts, lists and tuples of anything) with every DTensor made ``Sharded``.

    Tensors are not copied: the state must not change until the peer has fetched it, which
    torchft guarantees (it serves the state only until the step's commit vote).

    Raises:
        ValueError: for a DTensor on a mesh without dimension names (it could not be
            rebuilt on the receiving side).
    """
    if is_dtensor(tree):
        names = tree.device_mesh.mesh_dim_names
        if names is None:
            raise ValueError("a DTensor of the trainer state lies on a mesh without dimension "
                             "names, so a recovering replica group could not rebuild it: "
                             "create meshes with mesh_dim_names")
        local = tree.to_local()
        return Sharded(local, tuple(tree.placements), tree.shape, tree.stride(), tuple(names),
                       local.device.type != "cpu")
    if isinstance(tree, dict):
        return {key: to_wire(value) for key, value in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(to_wire(value) for value in tree)
    return tree


def from_wire(tree: Any, mesh: Callable[[tuple[str, ...]], DeviceMesh],
              device: torch.device) -> Any:
    """Undo ``to_wire``: rebuild each ``Sharded`` as a DTensor on ``mesh(mesh_dims)``.

    Args:
        tree: What ``to_wire`` made, as the transport delivered it (tensors on the CPU).
        mesh: The device mesh with the given dimension names, on this rank.
        device: Where a shard that lived on an accelerator goes back to (a CPU-offloaded
            shard stays on the CPU).
    """
    if isinstance(tree, Sharded):
        from torch.distributed.tensor import DTensor

        local = tree.local.to(device) if tree.on_accelerator else tree.local
        return DTensor.from_local(local, mesh(tree.mesh_dims), tree.placements,
                                  run_check=False, shape=tree.shape, stride=tree.stride)
    if isinstance(tree, dict):
        return {key: from_wire(value, mesh, device) for key, value in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(from_wire(value, mesh, device) for value in tree)
    return tree


def check_fits(module: torch.nn.Module, received: Any, name: str) -> None:
    """Refuse a received ``state_dict`` unless it has exactly ``module``'s keys, and each
    tensor its shape, dtype and (for a DTensor) layout.

    Raises:
        ValueError: naming the first key that differs.
    """
    if not isinstance(received, dict):
        raise ValueError(f"the state received for model {name!r} is a "
                         f"{type(received).__name__}, not a state_dict")
    current = module.state_dict()
    missing = sorted(current.keys() - received.keys())
    unexpected = sorted(map(str, received.keys() - current.keys()))
    if missing or unexpected:
        raise ValueError(
            f"the state received for model {name!r} does not fit it: missing {missing[:5]}, "
            f"unexpected {unexpected[:5]}; every replica group must build the same models"
        )
    for key, tensor in current.items():
        value = received[key]
        if _layout(value) is None or _layout(value) != _layout(tensor):
            raise ValueError(
                f"the state received for model {name!r} does not fit it at {key!r}: "
                f"{_describe(value)} where this group has {_describe(tensor)}; every replica "
                "group must build the same models on the same layout")


def copy_into(module: torch.nn.Module, received: dict[str, Any], name: str) -> None:
    """Copy a received ``state_dict`` into ``module``'s parameters and buffers in place.

    Raises:
        ValueError: if it does not fit (``check_fits``).
    """
    check_fits(module, received, name)
    with torch.no_grad():
        for key, tensor in module.state_dict().items():
            value = received[key]
            local = value.local if isinstance(value, Sharded) else local_tensor(value)
            local_tensor(tensor).copy_(local)


def _layout(value: Any) -> tuple[Any, ...] | None:
    """What must match between two ranks' tensors: a DTensor's placements, global shape and
    mesh dimensions (sent or rebuilt), then the local shape and dtype; None if not a tensor."""
    if isinstance(value, Sharded):
        return (value.placements, value.shape, value.mesh_dims, value.local.shape,
                value.local.dtype)
    if is_dtensor(value):
        local = value.to_local()
        return (tuple(value.placements), value.shape, tuple(value.device_mesh.mesh_dim_names
                                                            or ()), local.shape, local.dtype)
    if isinstance(value, torch.Tensor):
        return (None, None, None, value.shape, value.dtype)
    return None


def _describe(value: Any) -> str:
    layout = _layout(value)
    if layout is None:
        return f"a {type(value).__name__}"
    placements, shape, dims, local, dtype = layout
    if placements is None:
        return f"a {tuple(local)} {dtype} tensor"
    return (f"a {tuple(local)} {dtype} shard of a {tuple(shape)} tensor placed {placements} "
            f"on {dims}")
