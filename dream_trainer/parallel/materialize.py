"""Turning meta-device models into real, initialized ones, sharded or not."""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.overrides import TorchFunctionMode

from dream_trainer.parallel.dtensor import is_dtensor, local_tensor

_RANDOM_FILLS = frozenset({"uniform_", "normal_", "bernoulli_", "random_", "exponential_",
                           "geometric_", "log_normal_", "cauchy_"})


class FullTensorInit(TorchFunctionMode):
    """Run in-place initializers of DTensors on the full tensor, then keep the local shard.

    On a CPU mesh DTensor random ops draw only the local shard from the (identically seeded)
    generator, so every rank would get the same values and none would match a single-process
    run. Under this mode a random fill or ``torch.nn.init`` function applied to a DTensor runs
    on a full-size plain tensor, consuming the generator exactly as one process would; each
    rank then keeps its slice. Peak extra memory is one tensor's full size.
    """

    def __torch_function__(self, func: Callable[..., Any], types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        target = args[0] if args else kwargs.get("tensor")
        is_initializer = getattr(func, "__name__", None) in _RANDOM_FILLS \
            or getattr(func, "__module__", None) == "torch.nn.init"
        if not (is_initializer and is_dtensor(target)):
            return func(*args, **kwargs)
        from torch.distributed.tensor import distribute_tensor  # loaded: target is one

        local = target.to_local()
        full = torch.empty(target.shape, dtype=target.dtype, device=local.device)
        if args:
            func(full, *args[1:], **kwargs)
        else:
            func(**{**kwargs, "tensor": full})
        shard = distribute_tensor(full, target.device_mesh, target.placements,
                                  src_data_rank=None).to_local()
        with torch.no_grad():
            local.copy_(shard)
        return target


def has_meta_tensors(module: nn.Module) -> bool:
    """True when any parameter or buffer of ``module`` has no storage yet."""
    return any(t.is_meta for t in itertools.chain(module.parameters(), module.buffers()))


def materialize(module: nn.Module, device: torch.device) -> None:
    """Allocate ``module`` on ``device`` and run every submodule's ``reset_parameters``.

    Floating tensors are filled with NaN between allocation and reset, so that a tensor no
    initializer touched is caught by ``find_uninitialized`` instead of training on garbage.
    Submodules are reset in ``modules()`` order, the order in which eager construction runs
    them, and under ``FullTensorInit``, so sharded and unsharded models get the same weights
    from the same seed.
    """
    module.to_empty(device=device)
    with torch.no_grad():
        for tensor in itertools.chain(module.parameters(), module.buffers()):
            if tensor.is_floating_point():
                tensor.fill_(math.nan)
    with FullTensorInit():
        for submodule in module.modules():
            reset_module(submodule)


def reset_module(module: nn.Module) -> None:
    """Run ``module``'s own ``reset_parameters()`` (not its children's), if it has one."""
    # torch's own nn.MultiheadAttention only has the private name.
    reset = getattr(module, "reset_parameters", None) \
        or getattr(module, "_reset_parameters", None)
    if callable(reset):
        reset()


def find_uninitialized(name: str, module: nn.Module) -> list[str]:
    """Names of parameters/buffers of ``module`` still on meta or holding non-finite values.

    Only this rank's shards are inspected; combine ranks with ``any_rank_failed``.
    """
    bad = []
    named = itertools.chain(module.named_parameters(), module.named_buffers())
    for tensor_name, tensor in named:
        local = local_tensor(tensor)
        if local.is_meta:
            bad.append(f"{name}.{tensor_name} (still on the meta device)")
        elif local.is_floating_point() and not bool(torch.isfinite(local).all()):
            bad.append(f"{name}.{tensor_name} (not initialized: NaN or inf)")
    return bad


def any_rank_failed(failed: bool, device: torch.device,
                    group: dist.ProcessGroup | None = None) -> bool:
    """True on every rank of ``group`` (default: all) when ``failed`` is True on any of them
    (one all-reduce)."""
    if not (dist.is_initialized() and dist.get_world_size(group) > 1):
        return failed
    # gloo cannot all-reduce bool, so int32.
    flag = torch.tensor([int(failed)], dtype=torch.int32, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    return bool(flag.item())
