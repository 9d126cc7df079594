"""The trainer's full state as torch Distributed Checkpoint (DCP) saves and loads it."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from dream_trainer.checkpoint.layout import CheckpointError
from dream_trainer.checkpoint.rng import rng_state

if TYPE_CHECKING:
    from dream_trainer.trainer.abstract import AbstractTrainer


def rng_key(rank: int) -> str:
    """Each rank's generators are saved under their own key, so none is deduplicated away."""
    return f"rng_rank{rank}"


def optimizer_owner(trainer: AbstractTrainer, name: str,
                    optimizer: torch.optim.Optimizer) -> nn.Module:
    """The model whose parameters ``optimizer`` updates (needed to name its state by FQN).

    Raises:
        CheckpointError: if the optimizer spans several models or none.
    """
    wanted = {id(p) for group in optimizer.param_groups for p in group["params"]}
    for model in trainer.named_models().values():
        if wanted <= {id(p) for p in model.parameters()}:
            return model
    raise CheckpointError(
        f"optimizer {name!r} updates parameters that do not all belong to one model: give "
        "each model its own optimizer so its state can be saved and resharded by name"
    )


class TrainingState:
    """Models, optimizers, schedulers, trainer counters and callbacks, and this rank's RNG.

    Model and optimizer states come from ``get_model_state_dict``/``get_optimizer_state_dict``,
    so they are keyed by parameter name and sharded as the model is (DDP, FSDP2, TP), which
    lets DCP load them into a different number of ranks.

    Optimizer states are flattened (one entry per parameter and setting, e.g.
    ``param_groups.layers.0.w.lr``) when ``flat_optimizers``: pipeline stages hold different
    parameters, and DCP keeps only one rank's copy of a nested ``param_groups`` list, so the
    other stages would load foreign groups. Runs without a pipeline keep the nested form.

    Args:
        trainer: The trainer whose state this is.
        weights_only: Only the models (fine-tuning from another run).
        with_rng: Include this rank's generator state (absent when loading a checkpoint
            written by fewer ranks).
        flat_optimizers: Save (or load) optimizer states in the flattened form; by default
            when the trainer runs a pipeline.
    """

    def __init__(self, trainer: AbstractTrainer, weights_only: bool = False,
                 with_rng: bool = True, flat_optimizers: bool | None = None) -> None:
        self.trainer = trainer
        self.weights_only = weights_only
        self.with_rng = with_rng and not weights_only
        self.flat_optimizers = trainer.world.dims.pp > 1 if flat_optimizers is None \
            else flat_optimizers
        self.loaded_rng: dict[str, Any] | None = None
        self.resumed_mid_epoch = False

    # DCP's state-dict helpers are imported where used: the package takes about a second to
    # import. DCP recognizes this class as its Stateful protocol by its two methods.

    def state_dict(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import (get_model_state_dict,
                                                             get_optimizer_state_dict)

        trainer = self.trainer
        state: dict[str, Any] = {"models": {name: get_model_state_dict(model)
                                            for name, model in trainer.named_models().items()}}
        if self.weights_only:
            return state
        options = self._options()
        state["optimizers"] = {
            name: get_optimizer_state_dict(optimizer_owner(trainer, name, opt), opt,
                                           options=options)
            for name, opt in trainer.named_optimizers().items()}
        state["schedulers"] = {name: scheduler.state_dict()
                               for name, scheduler in trainer.named_schedulers().items()}
        state["trainer"] = trainer.state_dict()
        state["extra"] = trainer.extra_state_dict()
        if self.with_rng:
            state[rng_key(trainer.world.rank)] = rng_state()
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import (set_model_state_dict,
                                                             set_optimizer_state_dict)

        trainer = self.trainer
        for name, model in trainer.named_models().items():
            set_model_state_dict(model, state_dict["models"][name])
        if self.weights_only:
            return
        options = self._options()
        for name, optimizer in trainer.named_optimizers().items():
            set_optimizer_state_dict(optimizer_owner(trainer, name, optimizer), optimizer,
                                     state_dict["optimizers"][name], options=options)
        for name, scheduler in trainer.named_schedulers().items():
            scheduler.load_state_dict(state_dict["schedulers"][name])
        trainer.load_state_dict(state_dict["trainer"])
        trainer.load_extra_state_dict(state_dict.get("extra", {}))
        self.resumed_mid_epoch = int(state_dict["trainer"].get("batch_in_epoch", 0)) > 0
        self.loaded_rng = state_dict.get(rng_key(trainer.world.rank))

    def _options(self) -> Any:
        from torch.distributed.checkpoint.state_dict import StateDictOptions

        return StateDictOptions(flatten_optimizer_state_dict=self.flat_optimizers)
