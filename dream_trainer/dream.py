"""``DreamTrainer``: the loop with every standard capability, ready to subclass."""

from __future__ import annotations

from pydantic import Field

from dream_trainer.mixins.checkpoint import CheckpointConfigMixin, CheckpointMixin
from dream_trainer.mixins.eval import EvalConfigMixin, EvalMixin
from dream_trainer.mixins.logging import JSONLoggerConfigMixin, JSONLoggerMixin
from dream_trainer.mixins.setup import SetupConfigMixin, SetupMixin
from dream_trainer.trainer.base import BaseTrainer, BaseTrainerConfig
from dream_trainer.trainer.callback_collection import CallbackCollection


def default_callbacks() -> CallbackCollection:
    """A progress display (plain lines when stdout is not a terminal) and learning rates."""
    from dream_trainer.callbacks.lr_monitor import LRMonitor
    from dream_trainer.callbacks.progress_bar import ProgressBar

    return CallbackCollection([ProgressBar(), LRMonitor()])


class DreamTrainerConfig(BaseTrainerConfig, SetupConfigMixin, EvalConfigMixin,
                         CheckpointConfigMixin, JSONLoggerConfigMixin):
    """Everything ``DreamTrainer`` reads: run identity, schedule, devices, checkpoints, logs."""

    callbacks: CallbackCollection = Field(default_factory=default_callbacks)
    """By default a progress bar and an LR monitor; pass a list to replace them."""


class DreamTrainer(BaseTrainer, SetupMixin, EvalMixin, CheckpointMixin, JSONLoggerMixin):
    """``BaseTrainer`` with model setup, metrics, checkpoints and local logging.

    Subclass it and implement ``configure_models``, ``configure_optimizers``,
    ``configure_dataloaders``, ``training_step`` and ``validation_step`` (optionally
    ``init_weights``, ``configure_schedulers``, ``configure_metrics``). Checkpoints go to
    ``outputs/<project>/<group>/<experiment>/checkpoints`` and metrics to ``.../logs`` unless
    the config says otherwise. For Weights & Biases add ``WandBLoggerMixin`` (and its config
    mixin) after ``DreamTrainer`` in the bases: both loggers then receive everything.
    """

    config: DreamTrainerConfig
