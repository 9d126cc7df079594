"""Mixins: each adds one capability to ``BaseTrainer``, with its config counterpart."""

from dream_trainer.mixins.checkpoint import CheckpointConfigMixin, CheckpointMixin
from dream_trainer.mixins.csv_logger import CSVLoggerConfigMixin, CSVLoggerMixin
from dream_trainer.mixins.eval import EvalConfigMixin, EvalMixin
from dream_trainer.mixins.fault_tolerance import FaultTolerantConfigMixin, FaultTolerantMixin
from dream_trainer.mixins.logging import JSONLoggerConfigMixin, JSONLoggerMixin, LoggerMixin
from dream_trainer.mixins.setup import SetupConfigMixin, SetupMixin
from dream_trainer.mixins.tensorboard import TensorBoardLoggerConfigMixin, TensorBoardLoggerMixin
from dream_trainer.mixins.wandb import WandBLoggerConfigMixin, WandBLoggerMixin

__all__ = ["CSVLoggerConfigMixin", "CSVLoggerMixin", "CheckpointConfigMixin", "CheckpointMixin",
           "EvalConfigMixin", "EvalMixin", "FaultTolerantConfigMixin", "FaultTolerantMixin",
           "JSONLoggerConfigMixin", "JSONLoggerMixin",
           "LoggerMixin", "SetupConfigMixin", "SetupMixin", "TensorBoardLoggerConfigMixin",
           "TensorBoardLoggerMixin", "WandBLoggerConfigMixin", "WandBLoggerMixin"]
