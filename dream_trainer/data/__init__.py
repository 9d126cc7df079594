"""Data: splitting loaders across data-parallel ranks, resuming them, moving batches, and
rendering conversations and preference pairs for fine-tuning."""

from dream_trainer.data.chat import ChatDataset
from dream_trainer.data.preference import PreferenceDataset
from dream_trainer.data.samplers import ResumableSampler, ValidationBatches
from dream_trainer.data.sharded import ShardedStream

__all__ = ["ChatDataset", "PreferenceDataset", "ResumableSampler", "ShardedStream",
           "ValidationBatches"]
