"""Model building blocks that the trainer knows how to train and shard: ``MoE``, and the
conversion of transformers' and torchtitan's MoE modules into it."""

from dream_trainer.nn.hf_moe import moe_from_hf, replace_hf_moe_blocks
from dream_trainer.nn.moe import GroupedExperts, MoE, active_parameters
from dream_trainer.nn.titan_moe import moe_from_torchtitan, replace_torchtitan_moe_blocks

__all__ = ["GroupedExperts", "MoE", "active_parameters", "moe_from_hf", "moe_from_torchtitan",
           "replace_hf_moe_blocks", "replace_torchtitan_moe_blocks"]
