"""Turning meta-device models into real, initialized ones."""

from __future__ import annotations

import itertools
import math

import torch
from torch import nn
from torch.distributed.tensor import DTensor


def has_meta_tensors(module: nn.Module) -> bool:
    """True when any parameter or buffer of ``module`` has no storage yet."""
    return any(t.is_meta for t in itertools.chain(module.parameters(), module.buffers()))


def materialize(module: nn.Module, device: torch.device) -> None:
    """Allocate ``module`` on ``device`` and run every submodule's ``reset_parameters``.

    Floating tensors are filled with NaN between allocation and reset, so that a tensor no
    initializer touched is caught by ``find_uninitialized`` instead of training on garbage.
    Submodules are reset in ``modules()`` order, the order in which eager construction would
    have run them, so the same seed gives the same weights.
    """
    module.to_empty(device=device)
    with torch.no_grad():
        for tensor in itertools.chain(module.parameters(), module.buffers()):
            if tensor.is_floating_point():
                tensor.fill_(math.nan)
    for submodule in module.modules():
        # torch's own nn.MultiheadAttention only has the private name.
        reset = getattr(submodule, "reset_parameters", None) \
            or getattr(submodule, "_reset_parameters", None)
        if callable(reset):
            reset()


def find_uninitialized(name: str, module: nn.Module) -> list[str]:
    """Names of parameters/buffers of ``module`` still on meta or holding non-finite values."""
    bad = []
    named = itertools.chain(module.named_parameters(), module.named_buffers())
    for tensor_name, tensor in named:
        local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
        if local.is_meta:
            bad.append(f"{name}.{tensor_name} (still on the meta device)")
        elif local.is_floating_point() and not bool(torch.isfinite(local).all()):
            bad.append(f"{name}.{tensor_name} (not initialized: NaN or inf)")
    return bad
