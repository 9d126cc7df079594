"""The step's ``after_update`` action of mixture-of-experts models: every ``MoE`` layer moves
its balancing bias by the whole step's expert load (and keeps that load for a global-batch
auxiliary loss)."""

from __future__ import annotations

import weakref
from collections.abc import Iterable

import torch
from torch import nn

from dream_trainer.nn.moe import MoE, moe_layers
from dream_trainer.world.world import DistributedWorld


class ExpertBalancing:
    """``ExpertBalancing(world)(model, optimizer)`` updates the bias (and the ``global_load``
    of a global-batch auxiliary loss) of each ``MoE`` layer of ``model`` by the load of every
    micro-batch on every rank that holds different tokens (one process's batch); added to
    the step only when a model has such layers (``of``).

    Args:
        world: The run's topology: the load is summed over its ``batch_mesh`` (the
            data-parallel ranks times the context-parallel ones; not the tensor-parallel
            ranks, which route the same tokens, nor other pipeline stages, which hold other
            layers), read when the step runs.
    """

    @classmethod
    def of(cls, models: Iterable[nn.Module], world: DistributedWorld) -> ExpertBalancing | None:
        """The action for ``models``, or None when none of them has an ``MoE`` layer (the
        step then does nothing for experts)."""
        if not any(next(moe_layers(model), None) is not None for model in models):
            return None
        return cls(world)

    def __init__(self, world: DistributedWorld) -> None:
        self.world = world
        # Each model's layers are found once, not by walking every module at every step.
        self._layers: weakref.WeakKeyDictionary[nn.Module, list[MoE]] = \
            weakref.WeakKeyDictionary()

    def __call__(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        layers = self._layers.get(model)
        if layers is None:
            layers = self._layers[model] = list(moe_layers(model))
        if not layers:
            return
        mesh = self.world.batch_mesh
        group = None if mesh is None else mesh.get_group()
        for layer in layers:
            layer.update_bias(group)
