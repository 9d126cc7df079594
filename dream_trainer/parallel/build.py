"""What a layout builds the models from (``ModelBuild``), and the two build steps every layout
shares: giving the parallelized meta models storage, and their initial values.

The trainer's setup hands the layout one ``ModelBuild``; the layout reaches the trainer only
through it: the public hooks, the model attributes as a mapping, and the few facts of the run
it needs (the seed, the pretrained load).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, MutableMapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from dream_trainer.parallel.materialize import (FullTensorInit, find_uninitialized,
                                                has_meta_tensors, materialize,
                                                parameters_named)
from dream_trainer.parallel.parts import BuildHooks
from dream_trainer.world.agree import agree_any
from dream_trainer.world.world import DistributedWorld


class ModelAttributes(MutableMapping[str, nn.Module]):
    """The trainer's model attributes as a mapping: reading a name reads the attribute, and
    setting one rebinds it (a pipeline binds each stage there while the parts act on it).

    Args:
        owner: The trainer.
        names: The attributes ``configure_models`` assigned, in order.
    """

    def __init__(self, owner: object, names: list[str]) -> None:
        self._owner = owner
        self._names = list(names)

    def __getitem__(self, name: str) -> nn.Module:
        if name not in self._names:
            raise KeyError(name)
        module: nn.Module = getattr(self._owner, name)
        return module

    def __setitem__(self, name: str, module: nn.Module) -> None:
        if name not in self._names:
            raise KeyError(f"{name!r} is not a model attribute (models: {self._names})")
        setattr(self._owner, name, module)

    def __delitem__(self, name: str) -> None:
        raise TypeError("a model attribute cannot be removed during the build")

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)


@dataclass
class ModelBuild:
    """Everything a layout builds the models with.

    Args:
        hooks: The trainer's public hooks (``apply_*``, ``init_weights``).
        models: The model attributes (``ModelAttributes``).
        pretrained_weights: Plans the ``init_weights_from`` load of the models as they are
            when it is called (a ``PretrainedWeights``), or returns None without one.
        seed: The config's seed: generators are re-seeded from it before values are drawn,
            so that weights depend on it alone, whatever ``configure_models`` drew.
        own_init_weights: Whether the trainer overrides ``init_weights()``.
    """

    hooks: BuildHooks
    models: MutableMapping[str, nn.Module]
    pretrained_weights: Callable[[], Any]
    seed: int | None
    own_init_weights: bool

    def bound(self, name: str, module: nn.Module) -> _Bound:
        """A context in which the model attribute ``name`` holds ``module``; on exit it
        holds what it held before, and ``.module`` what it held at the end (a part may
        replace the module, as compilation does)."""
        return _Bound(self.models, name, module)


class _Bound:
    def __init__(self, models: MutableMapping[str, nn.Module], name: str,
                 module: nn.Module) -> None:
        self.models, self.name, self.module = models, name, module

    def __enter__(self) -> _Bound:
        self.previous = self.models[self.name]
        self.models[self.name] = self.module
        return self

    def __exit__(self, *exc: object) -> None:
        self.module = self.models[self.name]
        self.models[self.name] = self.previous


def materialize_models(build: ModelBuild, world: DistributedWorld) -> None:
    """Give every model storage on the device and its initial (or pretrained) values, for a
    layout that runs each model whole."""
    device = world.device
    pretrained = build.pretrained_weights()
    world.seed(build.seed)
    loaded: list[torch.Tensor] = []
    for name, model in build.models.items():
        names = pretrained.names(name) if pretrained is not None else set()
        if has_meta_tensors(model):
            materialize(model, device, skip=names, values=world.materialization.has_values)
        else:
            model.to(device)
        loaded += parameters_named(model, names)
    initialize(build, world, loaded, pretrained)


def initialize(build: ModelBuild, world: DistributedWorld,
               loaded: list[torch.Tensor] | None = None, pretrained: Any = None,
               run_init_weights: bool = True) -> None:
    """Run ``init_weights()`` (unless it already ran, on a pipeline's whole model), require
    every tensor to be initialized (but those ``pretrained`` will set, in ``loaded``), then
    load ``pretrained``.

    Raises:
        RuntimeError: on every rank, naming up to 10 tensors left uninitialized on any.
    """
    device = world.device
    loaded = loaded or []
    if not world.materialization.has_values:
        build.hooks.init_weights()
        return  # no values to draw in full, to check, nor any to load
    if run_init_weights:
        with FullTensorInit(skip=loaded):
            build.hooks.init_weights()
    # The parameters left for the pretrained weights still hold NaN; the load sets every
    # one of them or raises.
    bad = [entry for name, model in build.models.items()
           for entry in find_uninitialized(name, model, skip=loaded)]
    if agree_any(bool(bad), device):
        raise RuntimeError(
            "some model tensors were never initialized: "
            + (", ".join(bad[:10]) if bad else "(found on another rank)")
            + (f" and {len(bad) - 10} more" if len(bad) > 10 else "")
            + ". Give their module a reset_parameters() method or set them in "
            "init_weights() (buffers computed in __init__ are lost on the meta device)"
        )
    if pretrained is not None:
        pretrained.load(expected=loaded, device=device)
