"""Parameter names as the model was written: without the attributes wrappers nest it under."""

from __future__ import annotations

from torch import nn
from torch.nn.parallel import DistributedDataParallel

WRAPPER_ATTRIBUTES = frozenset({"_orig_mod", "_checkpoint_wrapped_module"})
"""Attributes under which torch.compile and activation checkpointing nest the module they wrap.
``get_model_state_dict`` leaves them out of its keys too, so names without them match
checkpoint keys."""


def clean_name(name: str) -> str:
    """``name`` without the torch.compile and activation-checkpointing wrapper segments."""
    return ".".join(part for part in name.split(".") if part not in WRAPPER_ATTRIBUTES)


def unwrap_ddp(model: nn.Module) -> nn.Module:
    """The module a DDP wrapper holds, or ``model`` itself."""
    return model.module if isinstance(model, DistributedDataParallel) else model


def canonical_name(model: nn.Module, name: str) -> str:
    """A name from ``model.named_parameters()`` without the DDP ``module.`` prefix and the
    wrapper segments: the parameter's name in the model as written."""
    if isinstance(model, DistributedDataParallel):
        name = name.removeprefix("module.")
    return clean_name(name)
