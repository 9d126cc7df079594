"""The lifecycle hooks, declared once: their names, arguments, order and timing.

``BaseTrainer.fit()`` fires them in this order::

    pre_launch
    pre_configure, post_configure
    pre_setup, post_setup
    pre_fit
    [sanity validation: pre_val_epoch, pre_val_batch/post_val_batch..., post_val_epoch]
    for each epoch:
        pre_epoch
        pre_train_epoch
        for each micro-batch:
            pre_train_batch
            [pre_optimizer_step, post_optimizer_step: inside step(), once per optimizer step]
            post_train_batch
            [end of an optimizer step: the trainer's end_of_step(), e.g. checkpoints; then
             validation here instead of after the epoch when val_every_n_steps is set]
        post_train_epoch
        pre_val_epoch, pre_val_batch/post_val_batch..., post_val_epoch
        post_epoch
    post_fit
    on_exception (instead of the rest, when fit() fails)
    on_log (whenever a logger mixin logs a dict of values, on global rank 0)

Both the trainer (as no-op methods a subclass may override) and every ``Callback`` receive them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn


class TrainerHooks:
    """No-op implementations of every lifecycle hook; the single declaration of the hook set."""

    def pre_launch(self) -> None:
        """Once, before the process group and device mesh are created."""

    def pre_configure(self) -> None:
        """Once, before ``configure_models`` builds the models on the meta device."""

    def post_configure(self) -> None:
        """Once, after the models exist on the meta device (no parameter storage yet)."""

    def pre_setup(self) -> None:
        """Once, before parallelism is applied and the models are materialized."""

    def post_setup(self) -> None:
        """Once, after models, optimizers, schedulers and dataloaders are ready."""

    def pre_fit(self) -> None:
        """Once, before the sanity validation and the first epoch."""

    def pre_epoch(self) -> None:
        """Once per epoch, before its training part."""

    def pre_train_epoch(self) -> None:
        """Once per epoch, after the models are put in train mode."""

    def pre_train_batch(self, batch: Any, batch_idx: int) -> None:
        """Once per micro-batch, after it is moved to the device, before ``training_step``."""

    def post_train_batch(self, result: dict[str, Any], batch_idx: int) -> None:
        """Once per micro-batch, with what ``training_step`` returned."""

    def pre_optimizer_step(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        """Once per ``step()`` call (per optimizer step, not per micro-batch), before clipping.

        ``global_step`` does not count this step yet: it grows after ``training_step``.
        """

    def post_optimizer_step(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        """Once per ``step()`` call, after the optimizer and scheduler stepped (``global_step``
        still excludes this step)."""

    def post_train_epoch(self, result: dict[str, Any]) -> None:
        """Once per epoch, with the epoch's training results averaged over batches and ranks."""

    def pre_val_epoch(self) -> None:
        """Before each validation pass (sanity check included), models in eval mode."""

    def pre_val_batch(self, batch: Any, batch_idx: int) -> None:
        """Once per validation batch, before ``validation_step``."""

    def post_val_batch(self, result: dict[str, Any], batch_idx: int) -> None:
        """Once per validation batch, with what ``validation_step`` returned."""

    def post_val_epoch(self, result: dict[str, Any]) -> None:
        """After each validation pass, with its results averaged over batches and ranks."""

    def post_epoch(self) -> None:
        """Once per epoch, after training and validation."""

    def post_fit(self) -> None:
        """Once, after the last epoch, also when ``max_steps`` or ``StopTraining`` (early
        stopping, preemption) ends training early."""

    def on_exception(self, exception: BaseException) -> None:
        """When ``fit()`` raises, before the process group is torn down."""

    def on_log(self, values: Mapping[str, float], step: int) -> None:
        """Each time the trainer logs scalar ``values`` at ``step``: on global rank 0, where
        loggers write, for every ``log_dict`` (training steps, epoch means, validation
        results, learning rates, a user's own). Only trainers with a logger mixin log."""


HOOK_NAMES: tuple[str, ...] = tuple(
    name for name, value in vars(TrainerHooks).items()
    if callable(value) and not name.startswith("_")
)
"""Every hook name, in declaration order."""

HOOK_PREFIXES: tuple[str, ...] = ("pre_", "post_", "on_")
"""A callback method with one of these prefixes must be a declared hook."""
