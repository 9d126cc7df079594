"""``GarbageCollection``: Python's cyclic garbage collector on a fixed schedule during ``fit()``."""

from __future__ import annotations

import gc
from typing import Any

from typing_extensions import override

from dream_trainer.trainer.callback import Callback


class GarbageCollection(Callback):
    """Replace automatic garbage collection during ``fit()`` by collections at fixed steps.

    Automatic collections start whenever allocation counts cross a threshold, so each rank
    pauses at a different moment and the others wait for it in the next collective. With this
    callback every rank collects the young generations at the same optimizer steps and
    everything at the end of each epoch. The collector's previous state is restored when
    ``fit()`` ends or fails.

    Args:
        every_n_steps: Collect generations 0 and 1 when the global step is a multiple of this.

    Raises:
        ValueError: if ``every_n_steps < 1``.
    """

    def __init__(self, every_n_steps: int = 100) -> None:
        if every_n_steps < 1:
            raise ValueError(
                f"GarbageCollection every_n_steps must be at least 1, got {every_n_steps}")
        self.every_n_steps = every_n_steps
        # Whether automatic collection was on when pre_fit turned it off; None outside fit().
        self._restore_enabled: bool | None = None

    @override
    def pre_fit(self) -> None:
        self._restore_enabled = gc.isenabled()
        gc.disable()

    @override
    def post_train_batch(self, result: dict[str, Any], batch_idx: int) -> None:
        trainer = self.trainer
        if not trainer.is_accumulating_gradients and trainer.global_step % self.every_n_steps == 0:
            gc.collect(generation=1)

    @override
    def post_epoch(self) -> None:
        gc.collect()

    @override
    def teardown(self) -> None:
        self._restore()

    def _restore(self) -> None:
        if self._restore_enabled:
            gc.enable()
        self._restore_enabled = None
