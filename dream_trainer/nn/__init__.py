"""Model building blocks that the trainer knows how to train and shard: ``MoE``, and the
conversion of transformers' and torchtitan's MoE modules into it; the preference losses."""

from dream_trainer.nn.hf_moe import moe_from_hf, replace_hf_moe_blocks
from dream_trainer.nn.moe import GroupedExperts, MoE, active_parameters
from dream_trainer.nn.preference import (dpo_loss, ipo_loss, sequence_log_probs, simpo_loss,
                                         split_pairs)
from dream_trainer.nn.titan_moe import moe_from_torchtitan, replace_torchtitan_moe_blocks

__all__ = ["GroupedExperts", "MoE", "active_parameters", "dpo_loss", "ipo_loss", "moe_from_hf",
           "moe_from_torchtitan", "replace_hf_moe_blocks", "replace_torchtitan_moe_blocks",
           "sequence_log_probs", "simpo_loss", "split_pairs"]
