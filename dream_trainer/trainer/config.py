"""``BaseTrainerConfig``: the run identity, the training schedule and the callbacks."""

from __future__ import annotations

from pydantic import Field, model_validator

from dream_trainer.configs.device import fixed_pipeline_microbatches
from dream_trainer.configs.training import TrainingParameters, pipeline_batch_problem
from dream_trainer.trainer.abstract import AbstractTrainerConfig
from dream_trainer.trainer.callback_collection import CallbackCollection


class BaseTrainerConfig(AbstractTrainerConfig):
    """Adds the training schedule and the callbacks to the run identity."""

    training_parameters: TrainingParameters
    """Epochs, batch sizes, accumulation, validation cadence, clipping."""
    callbacks: CallbackCollection = Field(default_factory=CallbackCollection)
    """Callbacks whose hooks run during ``fit()``, in this order."""

    @model_validator(mode="after")
    def _check_pipeline_batches(self) -> BaseTrainerConfig:
        # Batch sizes live apart from the pipeline settings, so their fit is checked here; a
        # degree of "auto" is checked by the same rule once resolved, at setup.
        microbatches = fixed_pipeline_microbatches(self.device_parameters)
        problem = pipeline_batch_problem(self.training_parameters, microbatches)
        if problem is not None:
            raise ValueError(problem)
        return self
