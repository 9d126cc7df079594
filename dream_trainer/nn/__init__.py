"""Model building blocks that the trainer knows how to train and shard: ``MoE``."""

from dream_trainer.nn.moe import GroupedExperts, MoE

__all__ = ["GroupedExperts", "MoE"]
