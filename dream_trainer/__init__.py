"""dream_trainer: a mixin-composed distributed training framework for PyTorch."""

from dream_trainer.dream import DreamTrainer, DreamTrainerConfig
from dream_trainer.trainer import (AbstractTrainer, AbstractTrainerConfig, BaseTrainer,
                                   BaseTrainerConfig, StopTraining)

__all__ = ["AbstractTrainer", "AbstractTrainerConfig", "BaseTrainer", "BaseTrainerConfig",
           "DreamTrainer", "DreamTrainerConfig", "StopTraining"]
__version__ = "0.1.0"
