"""Collectives of a step by mesh axis: torch's ``CommDebugMode`` plus the group and bytes."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor.debug import CommDebugMode
from torch.utils._pytree import tree_leaves

from dream_trainer.world.dims import MeshAxis
from dream_trainer.world.world import DistributedWorld


@dataclass
class AxisTraffic:
    """The collectives one rank issued on one mesh axis (or of one kind on it)."""

    count: int = 0
    bytes: int = 0

    def add(self, payload: int) -> None:
        self.count += 1
        self.bytes += payload


def group_axes(world: DistributedWorld) -> dict[str, str]:
    """Process-group name -> the mesh axis it spans (``"world"`` for the default group).

    A one-axis mesh over every rank reuses the default group, which then takes the axis name.
    """
    axes = {dist.group.WORLD.group_name: "world"}  # type: ignore[union-attr]
    if world.mesh is not None:
        for name in world.mesh.mesh_dim_names or ():
            axes[world.mesh.get_group(name).group_name] = name
        flat = world.get_mesh(MeshAxis.DP)
        if flat is not None:
            axes.setdefault(flat.get_group().group_name, MeshAxis.DP.value)
        # The gradient norm of FSDP2 x TP reduces over this one; spanning every rank, its
        # group may be the default one, which it then names.
        shard_tp = world.get_mesh(MeshAxis.DP_SHARD_TP)
        if shard_tp is not None:
            axes[shard_tp.get_group().group_name] = MeshAxis.DP_SHARD_TP.value
        # With expert parallelism dp_shard is the flattened efsdp x ep view (dense weights
        # shard and reduce over it); spanning every rank, it may be the default group.
        if world.dims.ep > 1:
            dp_shard = world.get_mesh(MeshAxis.DP_SHARD)
            assert dp_shard is not None
            axes[dp_shard.get_group().group_name] = MeshAxis.DP_SHARD.value
        if world.dims.cp > 1:
            _name_context_views(world, axes)
    return axes


def _name_context_views(world: DistributedWorld, axes: dict[str, str]) -> None:
    """Name the flattened views of context parallelism: ``dp_cp`` (metrics), then
    ``dp_shard_cp`` (FSDP2's shards), which wins where the two are one group.

    Either may span every rank and so be the default group. A view whose group is a mesh
    axis's own (on a mesh of cp alone, torch gives both the default group) keeps that axis's
    name: FSDP2's traffic then shares the ``cp`` axis with attention's keys and values.
    """
    dims = {axis.value for axis, _ in world.dims.mesh_axes()}
    for view in (MeshAxis.DP_CP, MeshAxis.DP_SHARD_CP):
        group = world.get_group(view)
        if group is not None and axes.get(group.group_name) not in dims:
            axes[group.group_name] = view.value


class AxisCommMode(CommDebugMode):
    """``CommDebugMode`` that also files each collective under its mesh axis, with its bytes.

    A collective's bytes are its full buffer, the size NCCL's tests report: the gathered
    output of an all-gather, the input of a reduce-scatter, the tensor of an all-reduce or
    broadcast. On a ring a rank sends about ``(n-1)/n`` of that for the first two and twice
    that for an all-reduce.

    Args:
        axes: Process-group name -> axis name (``group_axes``); other groups are filed as
            ``"group <name>"``.
    """

    def __init__(self, axes: Mapping[str, str]) -> None:
        super().__init__()
        # torch's per-module tracking registers another forward hook on a module each time
        # it runs, so a module run twice in one step (microbatches, gradient accumulation)
        # fails it; it only feeds the per-module tables, which a plan does not print.
        self.advanced_module_tracker = _Untracked()  # type: ignore[assignment]
        self.axes = dict(axes)
        self.traffic: dict[str, AxisTraffic] = {}
        self.kinds: dict[str, dict[str, AxisTraffic]] = {}
        """Axis -> kind (``all_gather``, ``reduce_scatter``, ``all_reduce``, ...) -> traffic."""

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        counted = self.get_total_counts()
        out = super().__torch_dispatch__(func, types, args, kwargs)
        if self.get_total_counts() > counted:  # CommDebugMode counted it as a collective
            self.record(self._axis(args, kwargs or {}), _kind(func), _payload(args, out))
        return out

    def record(self, axis: str, kind: str, payload: int) -> None:
        """File a message the dispatcher does not see (a pipeline's sends and receives)."""
        self.traffic.setdefault(axis, AxisTraffic()).add(payload)
        self.kinds.setdefault(axis, {}).setdefault(kind, AxisTraffic()).add(payload)

    def _axis(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
        name = _group_name(args, kwargs)
        if name is None:
            return "unknown group"
        return self.axes.get(name, f"group {name}")


class _Untracked:
    """What ``CommDebugMode`` reads of its module tracker, always at the top level."""

    name = "Global"
    is_bw = False
    activation_checkpointing = False
    module_parents_dict: dict[str, set[str]] = {"Global": set()}

    def __enter__(self) -> _Untracked:
        return self

    def __exit__(self, *args: object) -> None:
        return None


def _group_name(args: tuple[Any, ...], kwargs: dict[str, Any]) -> str | None:
    """Functional collectives name their group by a string; c10d ops pass the group."""
    for value in (*args, *kwargs.values()):
        if isinstance(value, dist.ProcessGroup):
            return value.group_name
        if isinstance(value, torch.ScriptObject):  # how the dispatcher hands c10d ops a group
            return dist.ProcessGroup.unbox(value).group_name
    for key in ("group_name", "tag"):
        if isinstance(kwargs.get(key), str):
            return kwargs[key]
    strings = [value for value in args if isinstance(value, str)]
    return strings[-1] if strings else None


def _payload(args: tuple[Any, ...], out: Any) -> int:
    """The largest of the bytes held by each argument and by the result.

    c10d ops take (outputs, inputs, ...) and functional ones take inputs and return outputs,
    so the largest side is the full buffer whichever way the collective goes.
    """
    sides = [*args, out]
    return max((sum(t.numel() * t.element_size() for t in tree_leaves(side)
                    if isinstance(t, torch.Tensor)) for side in sides), default=0)



def _kind(func: Any) -> str:
    """One name per collective, whether torch issued it as a c10d or a functional op."""
    name = func._overloadpacket.__name__.replace("_", "")
    for kind in ("allgather", "reducescatter", "allreduce", "alltoall", "broadcast"):
        if kind in name:
            return {"allgather": "all_gather", "reducescatter": "reduce_scatter",
                    "allreduce": "all_reduce", "alltoall": "all_to_all"}.get(kind, kind)
    return name
