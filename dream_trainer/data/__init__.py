"""Data: splitting loaders across data-parallel ranks, resuming them, and moving batches."""

from dream_trainer.data.samplers import ResumableSampler, ValidationBatches
from dream_trainer.data.sharded import ShardedStream

__all__ = ["ResumableSampler", "ShardedStream", "ValidationBatches"]
