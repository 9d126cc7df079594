"""Mixins: each adds one capability to ``BaseTrainer``, with its config counterpart."""

from dream_trainer.mixins.setup import SetupConfigMixin, SetupMixin

__all__ = ["SetupConfigMixin", "SetupMixin"]
