"""Data: splitting loaders across data-parallel ranks, resuming them, and moving batches."""

from dream_trainer.data.samplers import ResumableSampler

__all__ = ["ResumableSampler"]
