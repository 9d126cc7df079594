"""Mixins: each adds one capability to ``BaseTrainer``, with its config counterpart."""

from dream_trainer.mixins.checkpoint import CheckpointConfigMixin, CheckpointMixin
from dream_trainer.mixins.setup import SetupConfigMixin, SetupMixin

__all__ = ["CheckpointConfigMixin", "CheckpointMixin", "SetupConfigMixin", "SetupMixin"]
