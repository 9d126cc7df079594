"""A model's state dict for checkpoints and weight files, for every model: torch's
``get_model_state_dict``/``set_model_state_dict`` where they work, and the model's own
``state_dict``/``load_state_dict`` where a state-dict hook renames keys.

torch's functions map every key of ``state_dict()`` back to a parameter attribute, and fail
on a module whose hook writes other names than its attributes (torchtitan's fused q/k/v
layer writes ``wq``/``wk``/``wv`` for its one ``wqkv`` weight, and reads them back through a
load pre-hook). Such a model's state dict is its own, with the names its hooks give, so that
checkpoints, ``init_weights_from`` and exports use the names the model's authors chose.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from dream_trainer.parallel.names import clean_name, unwrap_ddp


def state_keys(model: nn.Module) -> set[str]:
    """The keys of ``model``'s state dict as its hooks write them, without wrapper
    segments."""
    return {clean_name(key) for key in unwrap_ddp(model).state_dict(keep_vars=True)}


def renames_keys(model: nn.Module) -> bool:
    """Whether a state-dict hook of ``model`` writes a key that is not the name of one of its
    parameters or buffers (wrapper segments aside)."""
    inner = unwrap_ddp(model)
    names = {clean_name(name) for name, _ in inner.named_parameters(remove_duplicate=False)}
    names |= {clean_name(name) for name, _ in inner.named_buffers(remove_duplicate=False)}
    return not state_keys(model) <= names


def model_state_dict(model: nn.Module) -> dict[str, Any]:
    """``model``'s state dict, keyed without wrapper segments (DDP's ``module.``, compiled
    and activation-checkpointed blocks'), with the names its state-dict hooks give."""
    if not renames_keys(model):
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        return get_model_state_dict(model)
    return {clean_name(key): value for key, value in unwrap_ddp(model).state_dict().items()}


def load_model_state_dict(model: nn.Module, state: dict[str, Any], strict: bool = True) -> None:
    """Load ``state`` (keyed as ``model_state_dict`` keys it) into ``model``, every key
    required unless not ``strict`` (the keys ``state`` lacks keep their values).

    Raises:
        RuntimeError: from ``load_state_dict`` when keys are missing or unexpected.
    """
    if not renames_keys(model):
        from torch.distributed.checkpoint.state_dict import (StateDictOptions,
                                                             set_model_state_dict)

        set_model_state_dict(model, state, options=StateDictOptions(strict=strict))
        return
    inner = unwrap_ddp(model)
    keys = {clean_name(key): key for key in inner.state_dict(keep_vars=True)}
    inner.load_state_dict({keys.get(name, name): value for name, value in state.items()},
                          strict=strict)


def frozen_keys(model: nn.Module) -> set[str]:
    """The state keys of ``model``'s parameters that do not require gradients (every name of
    a tied one), wrapper segments removed."""
    return {clean_name(name) for name, param
            in unwrap_ddp(model).named_parameters(remove_duplicate=False)
            if not param.requires_grad}
