"""Model weights in and out: Hugging Face safetensors (read into any parallel layout, written
from a live run) and exports of training checkpoints. Training checkpoints themselves (the
whole state, resumable) are ``dream_trainer.checkpoint``."""

from dream_trainer.weights.export import export_checkpoint

__all__ = ["export_checkpoint"]
