"""``EMA``: an exponential moving average of the trainable weights, validated in their place."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from typing_extensions import override

from dream_trainer.parallel.dtensor import local_tensor
from dream_trainer.parallel.names import canonical_name
from dream_trainer.trainer.callback import Callback

NUM_UPDATES = "num_updates"
"""The ``state_dict`` key of the update count; every other key names an averaged parameter."""

class EMA(Callback):
    """Average every trainable parameter, ``shadow = decay * shadow + (1 - decay) * weight``,
    and run every validation pass (the sanity check included) on the averages.

    The averages are updated after every ``every_n_steps``-th optimizer step and are saved in
    checkpoints; training always continues from the trained weights. Under FSDP2 each rank
    averages only its own shard of each parameter.

    Args:
        decay: Weight of the old average at each update, in (0, 1).
        every_n_steps: Update after every N-th optimizer step (N >= 1).

    Attributes:
        num_updates: Optimizer steps averaged in so far (one per updating ``step()`` call).

    Raises:
        ValueError: if ``decay`` is not in (0, 1) or ``every_n_steps`` is not a positive int.
    """

    def __init__(self, decay: float = 0.999, every_n_steps: int = 1) -> None:
        if not (isinstance(decay, (int, float)) and 0.0 < decay < 1.0):
            raise ValueError(f"EMA(decay={decay!r}): decay must be a number in (0, 1), such as "
                             "0.999 (the weight the average keeps at each update)")
        if isinstance(every_n_steps, bool) or not isinstance(every_n_steps, int) \
                or every_n_steps < 1:
            raise ValueError(f"EMA(every_n_steps={every_n_steps!r}): every_n_steps must be an "
                             "int >= 1 (1 updates the average after every optimizer step)")
        self.decay = float(decay)
        self.every_n_steps = every_n_steps
        self.num_updates = 0
        self._params: dict[str, nn.Parameter] = {}
        self._shadows: dict[str, torch.Tensor] = {}
        self._keys_by_optimizer: dict[torch.optim.Optimizer, list[str]] = {}
        self._backup: list[torch.Tensor] | None = None
        self._pending: dict[str, Any] = {}
        self._setup_begun = False
        self._tracking = False

    # -- hooks -----------------------------------------------------------------------------
    @override
    def pre_setup(self) -> None:
        # A new fit() builds new parameters: averages of the old ones no longer apply.
        self._params, self._shadows, self._keys_by_optimizer = {}, {}, {}
        self.num_updates = 0
        self._setup_begun, self._tracking = True, False

    @override
    def post_setup(self) -> None:
        self._ensure_tracking()

    @override
    def post_optimizer_step(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        # Updating here rather than in post_train_batch puts this step in the average before
        # the checkpoint mixin saves at this step (its post_train_batch runs before ours).
        # step() runs inside training_step, before the loop counts the step it takes.
        if (self.trainer.global_step + 1) % self.every_n_steps:
            return
        keys = self._keys_for(optimizer)
        if not keys:
            return
        with torch.no_grad():
            shadows = [local_tensor(self._shadows[key]) for key in keys]
            params = [local_tensor(self._params[key]) for key in keys]
            torch._foreach_lerp_(shadows, params, 1.0 - self.decay)
        self.num_updates += 1

    @override
    def pre_val_epoch(self) -> None:
        # No gathered FSDP2 copies are live here: training's backward and the loop's
        # end-of-validation reshard release them, so writing the shards is enough.
        with torch.no_grad():
            params = [local_tensor(param) for param in self._params.values()]
            self._backup = [param.clone() for param in params]
            shadows = [local_tensor(shadow) for shadow in self._shadows.values()]
            torch._foreach_copy_(params, shadows)

    @override
    def post_val_epoch(self, result: dict[str, Any]) -> None:
        self._restore()

    @override
    def on_exception(self, exception: BaseException) -> None:
        # A failure during validation must not leave the averages in place of the weights.
        self._restore()

    # -- state -----------------------------------------------------------------------------
    @override
    def state_dict(self) -> dict[str, Any]:
        """The averages by ``"<model>.<parameter name>"`` and ``"num_updates"``.

        The averages are the live tensors (DTensor shards under FSDP2), so checkpoints save
        them sharded and load them in place. Before setup, what ``load_state_dict`` was given.
        """
        # The checkpoint mixin resumes in the trainer's own post_setup, which runs before this
        # callback's: the averages must exist by then for DCP to load into them.
        self._ensure_tracking()
        if not self._tracking and self._pending:
            return dict(self._pending)
        return {NUM_UPDATES: self.num_updates, **self._shadows}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Copy saved averages into this run's; before setup, keep them until it.

        Raises:
            ValueError: if the saved parameter names differ from this run's trainable ones.
        """
        if not self._tracking:
            self._pending = dict(state_dict)
            return
        saved = {key: value for key, value in state_dict.items() if key != NUM_UPDATES}
        missing = sorted(self._shadows.keys() - saved.keys())
        unexpected = sorted(saved.keys() - self._shadows.keys())
        if missing or unexpected:
            raise ValueError(
                f"EMA state does not fit this run's trainable parameters: missing {missing}, "
                f"unexpected {unexpected}; load a state saved with the same models"
            )
        with torch.no_grad():
            for key, shadow in self._shadows.items():
                shadow.copy_(saved[key])
        self.num_updates = int(state_dict[NUM_UPDATES])

    # -- helpers ---------------------------------------------------------------------------
    def _ensure_tracking(self) -> None:
        """Create the averages from the current weights, once the trainer is set up."""
        if self._tracking or not self._setup_begun:
            return
        self._tracking = True
        for model_name, model in self.trainer.named_models().items():
            for name, param in model.named_parameters():
                if param.requires_grad:
                    key = f"{model_name}.{canonical_name(model, name)}"
                    self._params[key] = param
                    self._shadows[key] = param.detach().clone()
        if self._pending:
            pending, self._pending = self._pending, {}
            self.load_state_dict(pending)

    def _keys_for(self, optimizer: torch.optim.Optimizer) -> list[str]:
        """The averaged parameters that ``optimizer`` updates (cached per optimizer)."""
        keys = self._keys_by_optimizer.get(optimizer)
        if keys is None:
            owned = {id(param) for group in optimizer.param_groups for param in group["params"]}
            keys = [key for key, param in self._params.items() if id(param) in owned]
            self._keys_by_optimizer[optimizer] = keys
        return keys

    def _restore(self) -> None:
        if self._backup is None:
            return
        with torch.no_grad():
            torch._foreach_copy_([local_tensor(param) for param in self._params.values()],
                                 self._backup)
        self._backup = None


