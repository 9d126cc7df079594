"""Parallelism helpers for users writing their own setup hooks.

The data-parallel backends (``data_parallel``), the layout strategy (``layout``, the trainer's
``self.layout``) and mixed-precision handling (``precision``) are the trainer's own
mechanisms, reached through ``DeviceParameters`` and ``SetupMixin``.
"""

from dream_trainer.parallel.blocks import find_blocks
from dream_trainer.parallel.grad_norm import clip_grad_norm
from dream_trainer.parallel.materialize import FullTensorInit
from dream_trainer.parallel.pipeline import PipelineStages, split_model, stage_ids

__all__ = ["FullTensorInit", "PipelineStages", "clip_grad_norm", "find_blocks", "split_model",
           "stage_ids"]
