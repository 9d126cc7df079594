"""Callbacks: user code attached to the trainer's lifecycle hooks."""

from dream_trainer.callbacks.callback import Callback, RankZeroCallback
from dream_trainer.callbacks.collection import CallbackCollection
from dream_trainer.callbacks.hooks import HOOK_NAMES, TrainerHooks

__all__ = ["HOOK_NAMES", "Callback", "CallbackCollection", "RankZeroCallback", "TrainerHooks"]
