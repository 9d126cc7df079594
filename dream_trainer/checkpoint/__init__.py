"""Training checkpoints: their directories, the full state, retention, the run lock (used by
``CheckpointMixin``), and the bridges to plain weights: ``export_checkpoint`` and loading
``init_weights_from``. The Hugging Face format itself is ``dream_trainer.weights``, which
this package builds on and which never imports it."""

from dream_trainer.checkpoint.directory import CheckpointError, CheckpointInfo
from dream_trainer.checkpoint.export import export_checkpoint
from dream_trainer.checkpoint.trust import trust_globals

__all__ = ["CheckpointError", "CheckpointInfo", "export_checkpoint", "trust_globals"]
