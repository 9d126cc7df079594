"""The loop's position and counters as checkpoints keep them, converted on resume to this
run's topology (``BaseTrainer`` takes them from here)."""

from __future__ import annotations

import logging
from abc import abstractmethod
from collections.abc import Mapping
from typing import Any

from dream_trainer.data.stream import TrainBatches
from dream_trainer.parallel.precision import Precision
from dream_trainer.trainer.abstract import AbstractTrainer
from dream_trainer.trainer.callback_collection import CallbackCollection
from dream_trainer.trainer.step_stages import UpdateVote

logger = logging.getLogger(__name__)


class LoopState(AbstractTrainer):
    """``state_dict``/``load_state_dict`` of the loop: the epoch, the micro-batches done in it
    (in samples, so another data-parallel degree resumes at the same place), the global batch
    it was read with, what is still owed at the checkpoint's step, the gradient scaler and the
    callbacks' states; and the stateful train loader's position per rank."""

    callbacks: CallbackCollection
    precision: Precision
    update_vote: UpdateVote
    _train_batches: TrainBatches | None
    _epoch_done: bool
    _batches_done: int
    _start_batch: int
    _resharded: bool
    _validation_due: bool
    _epoch_result: dict[str, float] | None

    @property
    @abstractmethod
    def _samples_per_batch(self) -> int:
        """Samples in one micro-batch over every data-reading rank (``BaseTrainer``)."""

    def state_dict(self) -> dict[str, Any]:
        """The loop's position, the gradient scaler and every callback's state.

        The position says where a resumed run continues: the epoch, and how many of its
        micro-batches are done (0 once the epoch, validation included, has finished). A
        checkpoint taken at an optimizer step also says whether that step's validation is
        still to run (``validation_due``), and, at the last step of an epoch, the epoch's
        training results (``epoch_result``, as ``[key, value]`` pairs): the run resumed from it
        ends the epoch as the interrupted run would have.
        """
        done = self._epoch_done
        epoch, batch = (self.current_epoch + 1, 0) if done \
            else (self.current_epoch, self._batches_done)
        params = self.training_parameters
        pending = None if done else self._epoch_result
        return {
            "global_step": self.global_step,
            "current_epoch": epoch,
            "batch_in_epoch": batch,
            "samples_per_batch": self._samples_per_batch,
            "dp_size": self.world.dp_size,
            "train_batch_size": params.train_batch_size,
            "gradient_accumulation_steps": params.gradient_accumulation_steps,
            "validation_due": self._validation_due and not done,
            # Pairs, not a dict: DCP loads only the keys the loading run's own state has.
            "epoch_result": [] if pending is None else [[key, value]
                                                        for key, value in pending.items()],
            "precision": self.precision.state_dict(),
            "update_vote": self.update_vote.state_dict(),
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
            ValueError: if the global batch (samples per optimizer step) differs from the
                saved run's, or the samples done in the epoch do not fill whole accumulation
                windows of this run's batch size and data-parallel degree.
        """
        self._check_global_batch(state_dict)
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
        self._validation_due = bool(state_dict.get("validation_due", False))
        pairs = state_dict.get("epoch_result") or []
        self._epoch_result = {str(key): float(value) for key, value in pairs} if pairs else None
        self.precision.load_state_dict(state_dict.get("precision", {}))
        self.update_vote.load_state_dict(state_dict.get("update_vote", {}))
        self.callbacks.load_state_dict(state_dict.get("callbacks", {}))

    def _check_global_batch(self, state_dict: dict[str, Any]) -> None:
        """Refuse a resume that changes the samples per optimizer step: the epoch would have
        another number of steps, so the step count carried over and the schedule planned from
        it would no longer end together.

        Compared per replica group (``train_batch_size x dp_size x accumulation``): under
        fault tolerance the number of live groups changes the global batch by design.
        """
        if "gradient_accumulation_steps" not in state_dict:
            if "samples_per_batch" in state_dict and self.world.is_rank_zero:
                logger.warning(
                    "the checkpoint does not record its gradient accumulation (an older "
                    "dream_trainer wrote it): it cannot be checked that this run keeps its "
                    "global batch; if it does not, the epochs have another number of steps "
                    "than the step count and the schedule carried over assume")
            return
        params = self.training_parameters
        saved = (int(state_dict["train_batch_size"]), int(state_dict["dp_size"]),
                 int(state_dict["gradient_accumulation_steps"]))
        mine = (params.train_batch_size, self.world.dp_size, params.gradient_accumulation_steps)
        saved_batch, batch = saved[0] * saved[1] * saved[2], mine[0] * mine[1] * mine[2]
        if saved_batch == batch:
            return
        raise ValueError(
            f"cannot resume with another global batch: the checkpoint's run took "
            f"{saved_batch} samples per optimizer step (train_batch_size {saved[0]} x "
            f"{saved[1]} data-parallel ranks x gradient_accumulation_steps {saved[2]}) and "
            f"this run takes {batch} ({mine[0]} x {mine[1]} x {mine[2]}), so its epochs would "
            "have another number of steps than the step count and the schedule carried over "
            f"assume. Keep the global batch at {saved_batch}{_ways_to_keep(saved_batch, mine)}"
            ", or start a new run from the checkpoint's weights "
            "(SetupConfigMixin.init_weights_from=<the checkpoint's step directory>)"
        )


def _ways_to_keep(global_batch: int, factors: tuple[int, int, int]) -> str:
    """``" (for example ...)"``: the accumulation or batch size that restores ``global_batch``
    with this run's other factors, those that are whole numbers."""
    batch_size, ranks, accumulation = factors
    ways = []
    if global_batch % (batch_size * ranks) == 0:
        ways.append(f"gradient_accumulation_steps={global_batch // (batch_size * ranks)}")
    if global_batch % (ranks * accumulation) == 0:
        ways.append(f"train_batch_size={global_batch // (ranks * accumulation)}")
    return f" (for example {' or '.join(ways)})" if ways else ""
