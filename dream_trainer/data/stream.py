"""The train loader as the loop reads it: epoch by epoch, and resumable without replay.

Four kinds of train loader resume mid-epoch in four ways:

- a ``DataLoader`` over a map-style dataset has a ``ResumableSampler`` (see ``loaders``): the
  resumed epoch skips the samples already read without loading them, also on another number
  of data-parallel ranks;
- a *stateful* loader, one with ``state_dict()``/``load_state_dict()`` (torchdata's
  ``StatefulDataLoader``, over an ``IterableDataset`` say), or a ``DataLoader`` without worker
  processes over a dataset that has them: its state is checkpointed for each data-parallel
  rank and loaded back, so the resumed run continues where the loader was, reading nothing
  twice, in a time that does not grow with the position;
- a loader over a ``ShardedStream`` (see ``sharded``): each rank saves what its slots read, and
  a resume merges every rank's into one global position from which any number of ranks and
  workers continue the stream's one sample order;
- any other loader is read from the start of the epoch and the batches already done are
  discarded, which repeats them only if its order is deterministic.

A stateful loader is read as one stream: an epoch takes the next batches of the current
pass, and a new pass starts only when the current one is over, so that an endless stream is
never restarted from its beginning.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

from torch.utils.data import DataLoader

from dream_trainer.data.loaders import epoch_batches, has_resumable_sampler, set_sampler_epoch
from dream_trainer.data.sharded import loader_piece, merge_progress, stream_of

logger = logging.getLogger(__name__)


def state_holder(loader: Iterable[Any]) -> Any | None:
    """What keeps the loader's position: the loader itself when it has ``state_dict()`` and
    ``load_state_dict()``, its dataset when the loader reads it without worker processes (so
    the dataset's position is the loop's), or None."""
    if has_resumable_sampler(loader):
        return None
    if _is_stateful(loader):
        return loader
    dataset = getattr(loader, "dataset", None)
    if isinstance(loader, DataLoader) and loader.num_workers == 0 and _is_stateful(dataset):
        return dataset
    return None


def _is_stateful(value: Any) -> bool:
    return callable(getattr(value, "state_dict", None)) \
        and callable(getattr(value, "load_state_dict", None))


class TrainBatches:
    """Hands the loop each epoch's batches and keeps the loader's position for checkpoints.

    Args:
        loader: The (prepared) train loader.
        samples_per_batch: Samples per micro-batch over every data-parallel rank.
    """

    def __init__(self, loader: Iterable[Any], samples_per_batch: int) -> None:
        self.loader = loader
        self.samples_per_batch = samples_per_batch
        self.holder = state_holder(loader)
        self.stream = stream_of(loader)
        self._iterator: Iterator[Any] | None = None
        self._restored = False

    @property
    def stateful(self) -> bool:
        """True when the position is the loader's own state (checkpointed per rank)."""
        return self.holder is not None

    def epoch(self, epoch: int, start: int, stop: int) -> Iterator[Any]:
        """Batches ``start`` to ``stop`` of ``epoch`` (the iterator is created here, since
        creating one draws from the global random generator)."""
        set_sampler_epoch(self.loader, epoch)
        if not self.stateful:
            return epoch_batches(self.loader, start, stop, self.samples_per_batch)
        if start and not self._restored:
            logger.warning("the train loader's state was not in the checkpoint: the resumed "
                           "epoch reads it from where it is now")
        if self._iterator is None:
            self._iterator = iter(self.loader)
        return self._take(stop - start)

    def _take(self, count: int) -> Iterator[Any]:
        for taken in range(count):
            assert self._iterator is not None
            try:
                batch = next(self._iterator)
            except StopIteration:
                # The pass is over: the next epoch starts a new one, and an epoch that found
                # the pass already over (it ended with the previous epoch) starts it now.
                self._iterator = iter(self.loader)
                if taken:
                    return
                try:
                    batch = next(self._iterator)
                except StopIteration:
                    return
            yield batch

    # -- checkpoints ------------------------------------------------------------------------
    def state_dict(self) -> Any | None:
        """The loader's position (this rank's), or None when it keeps none."""
        if self.stream is not None:
            return loader_piece(self.loader, self.stream)
        return None if self.holder is None else self.holder.state_dict()

    def load_state_dict(self, states: Mapping[int, Any], saved_dp: int, dp_size: int,
                        dp_rank: int) -> None:
        """Restore this rank's position from every saved data-parallel rank's.

        A ``ShardedStream`` continues from the saved ranks' reads merged, on any number of
        ranks. Otherwise, with another number of data-parallel ranks than the checkpoint's,
        the loader (or its dataset) must define ``resplit_state(states, num_replicas,
        rank)``, which turns the saved ranks' states (a list, by saved rank) into this rank's.

        Raises:
            ValueError: if the number of data-parallel ranks changed and nothing can re-split
                the states.
        """
        if self.holder is None or not states:
            return
        if self.stream is not None:
            self._resume_stream([states[rank] for rank in range(saved_dp)])
        else:
            self.holder.load_state_dict(self._rank_state(states, saved_dp, dp_size, dp_rank))
        self._iterator = None
        self._restored = True

    def _rank_state(self, states: Mapping[int, Any], saved_dp: int, dp_size: int,
                    dp_rank: int) -> Any:
        if saved_dp == dp_size:
            return states[dp_rank]
        resplit = getattr(self.holder, "resplit_state", None) \
            or getattr(getattr(self.holder, "dataset", None), "resplit_state", None)
        if resplit is None:
            raise ValueError(
                f"the checkpoint holds the train loader's position for {saved_dp} "
                f"data-parallel ranks, and this run has {dp_size}: a stream's position "
                "belongs to the rank that read it, so resume with "
                f"{saved_dp} data-parallel ranks, read a dream_trainer.data.ShardedStream "
                "(its position is global), or give the loader or its dataset a "
                "resplit_state(states, num_replicas, rank) method that turns the saved "
                "ranks' states into this rank's (see the data guide)"
            )
        return resplit([states[rank] for rank in range(saved_dp)], dp_size, dp_rank)

    def _resume_stream(self, pieces: list[Any]) -> None:
        """Continue a ``ShardedStream`` from every saved rank's reads, merged.

        Raises:
            ValueError: if the checkpoint's positions were not a stream's.
        """
        assert self.stream is not None
        if not all(isinstance(piece, Mapping) and "reads" in piece for piece in pieces):
            raise ValueError(
                "the checkpoint's train loader position was not saved by a ShardedStream "
                "(the run that wrote it read another loader): resume with that loader"
            )
        self.stream.resume(merge_progress(pieces))

