"""Pydantic configs shared by the trainers and mixins."""

from dream_trainer.configs.base import ConfigModel
from dream_trainer.configs.checkpoint import CheckpointParameters
from dream_trainer.configs.cli import apply_cli_overrides
from dream_trainer.configs.device import DeviceParameters
from dream_trainer.configs.fault_tolerance import FaultToleranceParameters
from dream_trainer.configs.logging import LoggingParameters
from dream_trainer.configs.training import TrainingParameters

__all__ = ["CheckpointParameters", "ConfigModel", "DeviceParameters", "FaultToleranceParameters",
           "LoggingParameters", "TrainingParameters", "apply_cli_overrides"]
