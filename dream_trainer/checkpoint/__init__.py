"""Training checkpoints: layout, the full state, retention, the run lock (used by
``CheckpointMixin``). ``export_checkpoint`` lives with the weight formats in
``dream_trainer.weights`` and is exported here too."""

from dream_trainer.checkpoint.layout import CheckpointError, CheckpointInfo
from dream_trainer.checkpoint.trust import trust_globals
from dream_trainer.weights.export import export_checkpoint

__all__ = ["CheckpointError", "CheckpointInfo", "export_checkpoint", "trust_globals"]
