"""Initializing Hugging Face ``transformers`` models that were built on the meta device.

A ``PreTrainedModel`` sets its weights in ``post_init`` with its own ``_init_weights``:
normal(0, ``initializer_range``) for linear and embedding layers, ones for its RMSNorm (which
has no ``reset_parameters``), and the rotary embedding's ``inv_freq`` buffers recomputed
from the config. Built on the meta device none of that has values, so materialization runs
the same function again on the real tensors.

``transformers`` is never imported here: a model can only be a ``PreTrainedModel`` once the
user's code has imported it, so the check looks in ``sys.modules`` (as ``dtensor.py`` does).
"""

from __future__ import annotations

import sys
from collections.abc import Callable

import torch
from torch import nn

_MODELING = "transformers.modeling_utils"


def is_hf_model(module: nn.Module) -> bool:
    """True if ``module`` is a ``transformers.PreTrainedModel`` (FSDP2 subclasses included)."""
    modeling = sys.modules.get(_MODELING)
    return modeling is not None and isinstance(module, modeling.PreTrainedModel)


def init_hf_models(module: nn.Module) -> None:
    """Run each ``PreTrainedModel`` inside ``module`` (itself included) through its own init.

    Every submodule gets the ``_init_weights`` of the innermost ``PreTrainedModel`` that holds
    it, children before parents, as ``PreTrainedModel.initialize_weights`` dispatches it; the
    library's own entry point is not called because it marks modules as initialized, which
    would make a later call a silent no-op. Run it under ``FullTensorInit`` so that sharded
    parameters get the single-process values.
    """
    if _MODELING not in sys.modules:
        return
    with torch.no_grad():
        _init_outermost(module)


def _init_outermost(module: nn.Module) -> None:
    if is_hf_model(module):
        _apply(module, module._init_weights)  # type: ignore[operator]
        return
    for child in module.children():
        _init_outermost(child)


def _apply(module: nn.Module, init: Callable[[nn.Module], None]) -> None:
    for child in module.children():
        _apply(child, child._init_weights if is_hf_model(child) else init)  # type: ignore[arg-type]
    init(module)
