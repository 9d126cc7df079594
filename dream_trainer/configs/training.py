"""How long and how to train: epochs, batch sizes, accumulation, validation cadence."""

from __future__ import annotations


from typing import Literal

from pydantic import NonNegativeInt, PositiveFloat, PositiveInt, model_validator

from dream_trainer.configs.base import ConfigModel


class TrainingParameters(ConfigModel):
    """The loop's schedule. Every count is validated when the model is built."""

    n_epochs: PositiveInt | None
    """Number of passes over the training data; ``None`` trains until ``max_steps`` (a
    stream needs no epochs)."""
    train_batch_size: PositiveInt
    """Micro-batch size per rank."""
    val_batch_size: PositiveInt | None = None
    """Validation batch size per rank. ``None`` (not given): each validation loader keeps its
    own batch size, and the field reads as ``train_batch_size`` for code that builds a loader
    from it. Given, every validation loader must have it."""
    gradient_accumulation_steps: PositiveInt = 1
    """Micro-batches accumulated into one optimizer step."""
    train_steps_per_epoch: PositiveInt | None = None
    """Optimizer steps per epoch; ``None`` uses the whole train loader."""
    val_steps_per_epoch: PositiveInt | None = None
    """Validation batches per validation epoch; ``None`` uses the whole loader."""
    val_every_n_steps: PositiveInt | None = None
    """Validate every N optimizer steps; ``None`` validates once per epoch."""
    num_sanity_val_steps: NonNegativeInt = 0
    """Validation batches run before training starts, to catch bugs early."""
    gradient_clip_val: PositiveFloat | None = None
    """Clip the total gradient norm to this value in ``step()``; ``None`` disables clipping."""
    max_steps: PositiveInt | None = None
    """Stop after this many optimizer steps, even mid-epoch."""
    scheduler_interval: Literal["step", "epoch"] = "step"
    """When the configured schedulers step: ``"step"`` in ``step()``, after each optimizer
    step; ``"epoch"`` once after each training epoch (before its validation), so that a
    schedule counts epochs. A scheduler passed to ``step()`` explicitly steps there either
    way; schedulers stepped by a metric (``ReduceLROnPlateau``) step after validation."""

    @model_validator(mode="after")
    def _budget(self) -> TrainingParameters:
        if self.n_epochs is None and self.max_steps is None:
            raise ValueError("n_epochs=None trains until max_steps, so max_steps must be set "
                             "(or give n_epochs a number)")
        return self

    @model_validator(mode="after")
    def _default_val_batch_size(self) -> TrainingParameters:
        # Not given: it reads as train_batch_size (loaders built from it keep working) but
        # stays out of model_fields_set, so that each validation loader keeps its own size.
        if self.val_batch_size is None:
            object.__setattr__(self, "val_batch_size", self.train_batch_size)
        return self

    @property
    def val_batch_size_set(self) -> bool:
        """Whether ``val_batch_size`` was given. If not, it reads as ``train_batch_size`` and
        every validation loader may have a batch size of its own."""
        return "val_batch_size" in self.model_fields_set


def pipeline_batch_problem(params: TrainingParameters, microbatches: int) -> str | None:
    """Why a configured batch size does not split into a pipeline's ``microbatches``, or None.

    ``val_batch_size`` counts only when given: otherwise each validation loader keeps its own
    size, which setup checks on the loader.
    """
    fields = ("train_batch_size", "val_batch_size") if params.val_batch_size_set \
        else ("train_batch_size",)
    for field in fields:
        size = getattr(params, field)
        if size % microbatches:
            return (f"training_parameters.{field}={size} does not split into "
                    f"device_parameters.pipeline_microbatches={microbatches} (pipeline "
                    f"microbatches are equal slices of each batch): make {field} a multiple of "
                    f"{microbatches}, or set pipeline_microbatches to a divisor of it")
    return None
