"""The loop's position and counters as checkpoints keep them, converted on resume to this
run's topology (``BaseTrainer`` takes them from here)."""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Mapping
from typing import Any

from dream_trainer.data.stream import TrainBatches
from dream_trainer.parallel.precision import Precision
from dream_trainer.trainer.abstract import AbstractTrainer


class LoopState(AbstractTrainer):
    """``state_dict``/``load_state_dict`` of the loop: the epoch, the micro-batches done in it
    (in samples, so another data-parallel degree resumes at the same place), the gradient
    scaler and the callbacks' states; and the stateful train loader's position per rank."""

    precision: Precision
    _train_batches: TrainBatches | None
    _epoch_done: bool
    _batches_done: int
    _start_batch: int
    _resharded: bool

    @property
    @abstractmethod
    def _samples_per_batch(self) -> int:
        """Samples in one micro-batch over every data-reading rank (``BaseTrainer``)."""

    def state_dict(self) -> dict[str, Any]:
        """The loop's position, the gradient scaler and every callback's state.

        The position says where a resumed run continues: the epoch, and how many of its
        micro-batches are done (0 once the epoch, validation included, has finished).
        """
        epoch, batch = ((self.current_epoch + 1, 0) if self._epoch_done
                        else (self.current_epoch, self._batches_done))
        return {
            "global_step": self.global_step,
            "current_epoch": epoch,
            "batch_in_epoch": batch,
            "samples_per_batch": self._samples_per_batch,
            "dp_size": self.world.dp_size,
            "precision": self.precision.state_dict(),
            "callbacks": self.callbacks.state_dict(),
        }

    def data_state_dict(self) -> Any | None:
        """This rank's position in a stateful train loader (see ``TrainBatches``), or None
        when the position is the loop's own (a ``ResumableSampler``'s) or not kept."""
        return None if self._train_batches is None else self._train_batches.state_dict()

    def load_data_state_dict(self, states: Mapping[int, Any], saved_dp_size: int) -> None:
        """Restore the train loader's position from every saved data-parallel rank's.

        Raises:
            ValueError: if the number of data-parallel ranks changed and the loader cannot
                re-split its position.
        """
        if self._train_batches is not None:
            self._train_batches.load_state_dict(states, saved_dp_size, self.world.dp_size,
                                                self.world.dp_rank)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore what ``state_dict`` returned, converting the position to this topology.

        Raises:
            ValueError: if the samples done in the epoch do not fill whole accumulation
                windows of this run's batch size and data-parallel degree.
        """
        self.global_step = int(state_dict["global_step"])
        self.current_epoch = int(state_dict["current_epoch"])
        samples = int(state_dict.get("batch_in_epoch", 0)) * int(
            state_dict.get("samples_per_batch", self._samples_per_batch))
        window = self._samples_per_batch * self.training_parameters.gradient_accumulation_steps
        if samples % window:
            raise ValueError(
                f"cannot resume mid-epoch: the checkpoint's run had read {samples} samples of "
                f"epoch {self.current_epoch}, which is not a whole number of this run's "
                f"optimizer steps ({window} samples each: train_batch_size x data-parallel "
                "ranks x gradient_accumulation_steps); use a batch configuration that "
                "divides it, or resume from an epoch-boundary checkpoint"
            )
        self._start_batch = samples // self._samples_per_batch
        self._resharded = int(state_dict.get("dp_size", self.world.dp_size)) != self.world.dp_size
        self.precision.load_state_dict(state_dict.get("precision", {}))
        self.callbacks.load_state_dict(state_dict.get("callbacks", {}))
