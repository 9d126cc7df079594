"""The trainer interface and the training loop."""

from dream_trainer.trainer.abstract import AbstractTrainer, AbstractTrainerConfig, StopTraining
from dream_trainer.trainer.base import BaseTrainer, BaseTrainerConfig
from dream_trainer.trainer.dream import DreamTrainer, DreamTrainerConfig
from dream_trainer.trainer.phases import runs_on

__all__ = ["AbstractTrainer", "AbstractTrainerConfig", "BaseTrainer", "BaseTrainerConfig",
           "DreamTrainer", "DreamTrainerConfig", "StopTraining", "runs_on"]
