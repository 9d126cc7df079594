"""DTensor checks that do not import ``torch.distributed.tensor``.

Importing it costs about 0.7 s (it pulls in sympy), more than the rest of dream_trainer
together, and a plain or DDP run never needs it. No tensor can be a DTensor before that
module is loaded, so these checks look for it in ``sys.modules`` instead of importing it.
"""

from __future__ import annotations

import sys
from typing import Any

import torch


def is_dtensor(value: Any) -> bool:
    """True if ``value`` is a ``torch.distributed.tensor.DTensor``."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(value, module.DTensor)


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``tensor``: the local shard of a DTensor, or the tensor itself.

    Under ``no_grad`` a DTensor's ``to_local()`` is its storage, so in-place ops write through.
    """
    return tensor.to_local() if is_dtensor(tensor) else tensor


def full_value(tensor: torch.Tensor) -> torch.Tensor:
    """The whole of ``tensor`` as a plain tensor: a DTensor's ``full_tensor()`` (a collective
    over its mesh unless it is replicated), or the tensor itself."""
    if is_dtensor(tensor):
        return tensor.full_tensor()  # type: ignore[attr-defined,no-any-return]
    return tensor
