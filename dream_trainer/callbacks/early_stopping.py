"""``EarlyStopping``: end ``fit()`` when a monitored value stops improving or is not finite."""

from __future__ import annotations

import logging
import math
from typing import Any, Literal

from typing_extensions import override

from dream_trainer.errors import StopTraining
from dream_trainer.trainer.callback import Callback
from dream_trainer.world.agree import agree_any

logger = logging.getLogger(__name__)


class EarlyStopping(Callback):
    """Stop ``fit()`` on every rank when ``monitor`` has not improved for ``patience`` checks.

    A check happens after each of the loop's validation passes (sanity checks and extra
    passes run by ``evaluate()`` excluded). A key missing from the
    validation results is looked up in the latest training epoch results, each of which is
    checked once; without a validation loader the check runs after each training epoch.

    Args:
        monitor: The result key to watch, such as ``"val_loss"``.
        mode: ``"min"`` when lower is better, ``"max"`` when higher is better.
        patience: Checks in a row without improvement before training stops.
        min_delta: How much a value must beat the best one by to count as an improvement.
        check_finite: Stop at once when the value is NaN or infinite.

    Raises:
        ValueError: if ``monitor`` is empty, ``mode`` is unknown, ``patience < 1`` or
            ``min_delta < 0``.
    """

    def __init__(self, monitor: str, mode: Literal["min", "max"] = "min", patience: int = 3,
                 min_delta: float = 0.0, check_finite: bool = True) -> None:
        if not monitor:
            raise ValueError("EarlyStopping monitor must name a result key, such as 'val_loss'")
        if mode not in ("min", "max"):
            raise ValueError(f"EarlyStopping mode must be 'min' or 'max', got {mode!r}")
        if patience < 1:
            raise ValueError(f"EarlyStopping patience must be at least 1, got {patience}")
        if not min_delta >= 0:
            raise ValueError(f"EarlyStopping min_delta must be >= 0, got {min_delta}: the "
                             "direction of improvement is set by mode")
        self.monitor = monitor
        self.mode = mode
        self.patience = patience
        self.min_delta = min_delta
        self.check_finite = check_finite
        self.best = math.inf if mode == "min" else -math.inf
        self.wait = 0
        # The last training epoch results, and whether their value still awaits its check:
        # with val_every_n_steps several validations can follow one training epoch.
        self._train_result: dict[str, Any] | None = None
        self._train_result_checked = False

    # -- hooks ---------------------------------------------------------------------------------
    @override
    def post_train_epoch(self, result: dict[str, Any]) -> None:
        self._train_result, self._train_result_checked = result, False
        if self.trainer.val_dataloader is None:
            self._check(self._value(result, {}))

    @override
    def post_val_epoch(self, result: dict[str, Any]) -> None:
        if self.trainer.sanity_checking or self.trainer.evaluating:
            return  # not one of the loop's validations: nothing to stop
        if self.monitor in result:
            self._check(float(result[self.monitor]))
        elif self._train_result is None:
            # A validation inside the first epoch (val_every_n_steps): the key may still be a
            # training key, which only the end of the epoch can show.
            return
        elif not self._train_result_checked:
            self._check(self._value(self._train_result, result))

    # -- decision ------------------------------------------------------------------------------
    def _value(self, train_result: dict[str, Any], val_result: dict[str, Any]) -> float:
        """The monitored value of ``train_result``, marking it checked.

        Raises:
            ValueError: if neither result has the monitored key.
        """
        if self.monitor not in train_result:
            available = sorted({*val_result, *train_result})
            raise ValueError(
                f"EarlyStopping monitor {self.monitor!r} is in neither the validation nor the "
                f"training results; available keys: {available}"
            )
        self._train_result_checked = True
        return float(train_result[self.monitor])

    def _check(self, value: float) -> None:
        """Update the best value and the wait count; stop every rank when one rank says so.

        Raises:
            StopTraining: on every rank, when any rank decided to stop.
        """
        reason = self._update(value)
        # The results are identical on every rank, so the ranks agree already; one all-reduce
        # makes sure, because a single rank raising StopTraining would leave its peers hanging.
        if agree_any(reason is not None, self.trainer.world.device):
            raise StopTraining(reason or "EarlyStopping: another rank decided to stop")

    def _update(self, value: float) -> str | None:
        """Fold ``value`` into the state; return why training must stop, or None."""
        if self.check_finite and not math.isfinite(value):
            return (f"EarlyStopping: {self.monitor} is {value}, not finite (best "
                    f"{self.best:.6g}, patience {self.patience})")
        if self._improves(value):
            self.best, self.wait = value, 0
            return None
        self.wait += 1
        if self.wait < self.patience:
            return None
        return (f"EarlyStopping: {self.monitor} did not improve on its best {self.best:.6g} by "
                f"more than {self.min_delta} for {self.wait} checks (patience {self.patience})")

    def _improves(self, value: float) -> bool:
        if self.mode == "min":
            return value < self.best - self.min_delta
        return value > self.best + self.min_delta

    # -- state ---------------------------------------------------------------------------------
    @override
    def state_dict(self) -> dict[str, Any]:
        return {"monitor": self.monitor, "mode": self.mode, "best": self.best,
                "wait": self.wait}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore the best value and wait count, unless they were kept for another monitor."""
        saved = (state_dict.get("monitor"), state_dict.get("mode"))
        if saved != (self.monitor, self.mode):
            # A best value of another key or direction would stop the run at once or never.
            logger.warning("EarlyStopping: the checkpoint tracked %s (mode %s), this run "
                           "monitors %s (mode %s): starting from scratch",
                           *saved, self.monitor, self.mode)
            return
        self.best = float(state_dict["best"])
        self.wait = int(state_dict["wait"])
