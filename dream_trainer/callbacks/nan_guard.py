"""``NanGuard``: stop training, or skip the update, when it produces NaN or infinity."""

from __future__ import annotations

import logging
from typing import Any, Literal, NamedTuple, get_args

import torch
from torch import nn
from typing_extensions import override

from dream_trainer.parallel.dtensor import local_tensor
from dream_trainer.parallel.materialize import any_rank_failed
from dream_trainer.trainer.callback import Callback

logger = logging.getLogger(__name__)

NanGuardMode = Literal["raise", "skip"]
GRAD_NORM = "grad_norm"
"""The result key of the value ``step()`` returns, checked whenever a step returns it."""


class _Value(NamedTuple):
    """One result value waiting for the next check, and where it came from."""

    step: int
    batch_idx: int
    epoch: int
    key: str
    value: torch.Tensor


class NanGuard(Callback):
    """Catch non-finite training values: raise where they first appeared, or skip the update.

    ``"raise"`` keeps the ``keys`` (and ``"grad_norm"``) of every training result as device
    tensors and checks them together every ``check_every_n_steps`` optimizer steps and at each
    epoch's end: one host sync per check, none per step. ``"skip"`` checks the gradients in
    ``pre_optimizer_step``, at the cost of one host sync and one all-reduce per optimizer step,
    and drops the gradients of a step that has a non-finite one on any rank.

    Args:
        mode: ``"raise"`` or ``"skip"``.
        check_every_n_steps: In raise mode, optimizer steps between checks (skip mode checks
            every step and requires 1).
        keys: In raise mode, the training-result keys to check; each must be in every result.

    Attributes:
        skipped_steps: In skip mode, optimizer steps skipped so far (kept in checkpoints).

    Raises:
        ValueError: if an argument is invalid.
    """

    def __init__(self, mode: NanGuardMode = "raise", check_every_n_steps: int = 1,
                 keys: tuple[str, ...] = ("loss",)) -> None:
        if mode not in get_args(NanGuardMode):
            raise ValueError(f"NanGuard(mode={mode!r}): mode must be 'raise' (stop at the first "
                             "non-finite value) or 'skip' (skip steps with non-finite gradients)")
        if isinstance(check_every_n_steps, bool) or not isinstance(check_every_n_steps, int) \
                or check_every_n_steps < 1:
            raise ValueError(f"NanGuard(check_every_n_steps={check_every_n_steps!r}): must be an "
                             "int >= 1")
        if mode == "skip" and check_every_n_steps != 1:
            raise ValueError(f"NanGuard(mode='skip', check_every_n_steps={check_every_n_steps}): "
                             "skip mode must check every step to keep non-finite gradients out "
                             "of the weights; leave check_every_n_steps at 1")
        if not isinstance(keys, tuple) or not all(isinstance(k, str) and k for k in keys):
            raise ValueError(f"NanGuard(keys={keys!r}): keys must be a tuple of result keys, "
                             "such as ('loss',)")
        self.mode: NanGuardMode = mode
        self.check_every_n_steps = check_every_n_steps
        self.keys = keys
        self.skipped_steps = 0
        self._pending: list[_Value] = []
        self._step = 0
        self._batch_idx = 0
        self._check_grad_norm = True

    # -- hooks -----------------------------------------------------------------------------
    @override
    def pre_launch(self) -> None:
        # float16's GradScaler skips steps whose gradients overflowed and lowers its scale:
        # there an infinite gradient norm is routine, and dropping the gradients first would
        # hide the overflow from the scaler, so its scale would never come down.
        float16 = self.trainer.config.device_parameters.param_dtype == torch.float16
        if float16 and self.mode == "skip":
            raise ValueError(
                "NanGuard(mode='skip') cannot run with param_dtype=float16: the gradient "
                "scaler already skips steps with non-finite gradients; use mode='raise' (which "
                "then checks the loss only) or bfloat16"
            )
        self._check_grad_norm = not float16

    @override
    def pre_train_batch(self, batch: Any, batch_idx: int) -> None:
        # Steps are named as training_step sees them: the loop counts a step only after it.
        self._step, self._batch_idx = self.trainer.global_step, batch_idx

    @override
    def post_train_batch(self, result: dict[str, Any], batch_idx: int) -> None:
        if self.mode != "raise":
            return
        for key in self._keys_in(result):
            self._pending.append(_Value(self._step, batch_idx, self.trainer.current_epoch, key,
                                        self._as_scalar(key, result[key])))
        trainer = self.trainer
        if not trainer.is_accumulating_gradients \
                and trainer.global_step % self.check_every_n_steps == 0:
            self._check()

    @override
    def pre_optimizer_step(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        if self.mode != "skip":
            return
        grads = [local_tensor(param.grad) for param in model.parameters() if param.grad is not None]
        finite = not grads or bool(torch.stack([torch.isfinite(g).all() for g in grads]).all())
        # Every rank must skip or step together: FSDP2 and tensor-parallel ranks each hold
        # only part of the gradients.
        if not any_rank_failed(not finite, self.trainer.world.device):
            return
        optimizer.zero_grad(set_to_none=True)
        self.skipped_steps += 1
        if self.trainer.world.is_rank_zero:
            logger.warning("NanGuard: non-finite gradients at global step %d (batch %d of epoch "
                           "%d): skipped this optimizer step (%d skipped so far)", self._step,
                           self._batch_idx, self.trainer.current_epoch, self.skipped_steps)

    @override
    def post_train_epoch(self, result: dict[str, Any]) -> None:
        if self.mode == "raise":
            self._check()

    @override
    def on_exception(self, exception: BaseException) -> None:
        self._pending.clear()

    # -- state -----------------------------------------------------------------------------
    @override
    def state_dict(self) -> dict[str, Any]:
        """``{"skipped_steps": n}``."""
        return {"skipped_steps": self.skipped_steps}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore the skipped-step count."""
        self.skipped_steps = int(state_dict["skipped_steps"])

    # -- helpers ---------------------------------------------------------------------------
    def _keys_in(self, result: dict[str, Any]) -> list[str]:
        """The keys of ``result`` to check.

        Raises:
            KeyError: if a configured key is missing from ``result``.
        """
        missing = [key for key in self.keys if key not in result]
        if missing:
            raise KeyError(f"NanGuard checks {missing} but training_step returned only "
                           f"{sorted(result)}: pass keys=(...) naming values it returns")
        keys = list(self.keys)
        if self._check_grad_norm and GRAD_NORM in result and GRAD_NORM not in keys:
            keys.append(GRAD_NORM)
        return keys

    def _as_scalar(self, key: str, value: Any) -> torch.Tensor:
        """``value`` as a float32 scalar on the device that is non-finite exactly when it is.

        Raises:
            TypeError: if ``value`` is neither a tensor nor a real number.
        """
        device = self.trainer.world.device
        if isinstance(value, torch.Tensor):
            scalar = value.detach()
            if scalar.numel() != 1:
                # amax propagates NaN, and an element is infinite exactly when the largest
                # magnitude is.
                scalar = scalar.abs().amax() if scalar.numel() else scalar.new_zeros(())
            return scalar.reshape(()).to(device=device, dtype=torch.float32)
        if isinstance(value, (int, float)):
            return torch.full((), float(value), device=device)
        raise TypeError(f"NanGuard checks {key!r}, but training_step returned a "
                        f"{type(value).__name__} for it: return a tensor or a number")

    def _check(self) -> None:
        """Raise if a pending value is non-finite, naming the first one (one host sync).

        Raises:
            FloatingPointError: naming the global step, batch and values where it appeared.
        """
        if not self._pending:
            return
        pending, self._pending = self._pending, []
        finite = torch.isfinite(torch.stack([entry.value for entry in pending]))
        if bool(finite.all()):
            return
        flags = finite.tolist()
        first = pending[flags.index(False)]
        values = ", ".join(f"{entry.key}={entry.value.item()}"
                           for entry, ok in zip(pending, flags)
                           if not ok and entry.step == first.step
                           and entry.batch_idx == first.batch_idx)
        raise FloatingPointError(
            f"non-finite training value at global step {first.step} (batch {first.batch_idx} "
            f"of epoch {first.epoch}): {values}. Look for a too-high learning rate, a log or "
            "division of zero, or bad data in that batch; NanGuard(mode='skip') skips such "
            "steps instead"
        )
