"""Model building blocks that the trainer knows how to train and shard: ``MoE``, and the
conversion of transformers' MoE blocks into it."""

from dream_trainer.nn.hf_moe import moe_from_hf, replace_hf_moe_blocks
from dream_trainer.nn.moe import GroupedExperts, MoE, active_parameters

__all__ = ["GroupedExperts", "MoE", "active_parameters", "moe_from_hf", "replace_hf_moe_blocks"]
