"""The trainer interface, the training loop, the lifecycle hooks and the callback base."""

from dream_trainer.trainer.abstract import AbstractTrainer, AbstractTrainerConfig, StopTraining
from dream_trainer.trainer.base import BaseTrainer, BaseTrainerConfig
from dream_trainer.trainer.history import History
from dream_trainer.trainer.phases import runs_on

__all__ = ["AbstractTrainer", "AbstractTrainerConfig", "BaseTrainer", "BaseTrainerConfig",
           "History", "StopTraining", "runs_on"]
