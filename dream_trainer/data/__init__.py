"""Data: splitting loaders across data-parallel ranks, resuming them, and moving batches."""

from dream_trainer.data.samplers import ResumableSampler, ValidationBatches

__all__ = ["ResumableSampler", "ValidationBatches"]
