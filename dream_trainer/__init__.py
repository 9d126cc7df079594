"""dream_trainer: a mixin-composed distributed training framework for PyTorch."""

from dream_trainer.dream import DreamTrainer, DreamTrainerConfig
from dream_trainer.trainer import (AbstractTrainer, AbstractTrainerConfig, BaseTrainer,
                                   BaseTrainerConfig, History, StopTraining)
from dream_trainer.utils import import_noise

__all__ = ["AbstractTrainer", "AbstractTrainerConfig", "BaseTrainer", "BaseTrainerConfig",
           "DreamTrainer", "DreamTrainerConfig", "History", "StopTraining"]
__version__ = "0.1.0"

# Before a script imports transformers (which imports torchao): import-time log records of
# other libraries that say nothing about the run (see the module for the two it drops).
import_noise.install()
