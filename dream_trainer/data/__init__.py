"""Data: splitting loaders across data-parallel ranks, resuming them, moving batches, and
rendering conversations for fine-tuning."""

from dream_trainer.data.chat import ChatDataset
from dream_trainer.data.samplers import ResumableSampler, ValidationBatches
from dream_trainer.data.sharded import ShardedStream

__all__ = ["ChatDataset", "ResumableSampler", "ShardedStream", "ValidationBatches"]
