"""The trainer interface and the training loop."""

from dream_trainer.trainer.abstract import AbstractTrainer, AbstractTrainerConfig, StopTraining
from dream_trainer.trainer.base import BaseTrainer, BaseTrainerConfig

__all__ = ["AbstractTrainer", "AbstractTrainerConfig", "BaseTrainer", "BaseTrainerConfig",
           "StopTraining"]
