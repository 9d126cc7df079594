"""The step's ``after_update`` action of mixture-of-experts models: every ``MoE`` layer moves
its balancing bias by the whole step's expert load."""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from dream_trainer.nn.moe import MoE, moe_layers


class ExpertBalancing:
    """``ExpertBalancing(dp_group)(model, optimizer)`` updates the bias of each ``MoE`` layer of
    ``model`` by the load of every micro-batch on every data-parallel rank (one process's
    batch); added to the step only when a model has such layers (``of``).

    Args:
        dp_group: Returns the data-parallel process group (None on one rank) when the step
            runs.
    """

    @classmethod
    def of(cls, models: Iterable[nn.Module],
           dp_group: Callable[[], Any | None]) -> ExpertBalancing | None:
        """The action for ``models``, or None when none of them has an ``MoE`` layer (the
        step then does nothing for experts)."""
        if not any(next(moe_layers(model), None) is not None for model in models):
            return None
        return cls(dp_group)

    def __init__(self, dp_group: Callable[[], Any | None]) -> None:
        self.dp_group = dp_group
        # Each model's layers are found once, not by walking every module at every step.
        self._layers: weakref.WeakKeyDictionary[nn.Module, list[MoE]] = \
            weakref.WeakKeyDictionary()

    def __call__(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        layers = self._layers.get(model)
        if layers is None:
            layers = self._layers[model] = list(moe_layers(model))
        if not layers:
            return
        group = self.dp_group()
        for layer in layers:
            layer.update_bias(group)
