"""Checkpoint layout, state, and export (used by ``CheckpointMixin``)."""

from dream_trainer.checkpoint.export import export_checkpoint
from dream_trainer.checkpoint.layout import CheckpointError, CheckpointInfo

__all__ = ["CheckpointError", "CheckpointInfo", "export_checkpoint"]
