"""Data loaders that split across ranks and resume mid-epoch on any number of ranks."""

from __future__ import annotations

import itertools
import logging
import math
from collections.abc import Iterable, Iterator, Sized
from typing import Any

import torch
from torch.utils.data import (BatchSampler, DataLoader, IterableDataset, RandomSampler, Sampler,
                              SequentialSampler)
from torch.utils.data.distributed import DistributedSampler

logger = logging.getLogger(__name__)


class ResumableSampler(Sampler[int]):
    """Splits one per-epoch order of the dataset across ranks, and can start mid-epoch.

    The order is ``DistributedSampler``'s (a permutation seeded by ``seed + epoch``, or the
    natural order), so both give the same batches. ``start_at(n)`` makes the next epoch
    iteration skip the first ``n`` samples of the *global* order and split the rest across
    the ranks: a run resumed on a different number of ranks reads exactly the samples the
    interrupted run had not reached. Padding (or, with ``drop_last``, trimming) makes every
    rank read the same number of samples.
    """

    def __init__(self, dataset: Sized, num_replicas: int = 1, rank: int = 0,
                 shuffle: bool = True, seed: int = 0, drop_last: bool = False) -> None:
        if not 0 <= rank < num_replicas:
            raise ValueError(f"rank {rank} is outside num_replicas={num_replicas}")
        self.dataset = dataset
        self.num_replicas, self.rank = num_replicas, rank
        self.shuffle, self.seed, self.drop_last = shuffle, seed, drop_last
        self.epoch = 0
        self.start_sample = 0

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch's order; a new epoch starts from its first sample."""
        if epoch != self.epoch:
            self.start_sample = 0
        self.epoch = epoch

    def start_at(self, global_sample: int) -> None:
        """Skip the first ``global_sample`` samples of the current epoch's order."""
        if not 0 <= global_sample <= len(self.dataset):
            raise ValueError(f"cannot start at sample {global_sample} of {len(self.dataset)}")
        self.start_sample = global_sample

    def _remaining(self) -> list[int]:
        if self.shuffle:
            generator = torch.Generator()
            generator.manual_seed(self.seed + self.epoch)
            order = torch.randperm(len(self.dataset), generator=generator).tolist()
        else:
            order = list(range(len(self.dataset)))
        remaining = order[self.start_sample:]
        if self.drop_last:
            return remaining[: len(remaining) - len(remaining) % self.num_replicas]
        padding = -len(remaining) % self.num_replicas
        return remaining + (remaining * math.ceil(padding / max(len(remaining), 1)))[:padding]

    def __iter__(self) -> Iterator[int]:
        return iter(self._remaining()[self.rank::self.num_replicas])

    def __len__(self) -> int:
        remaining = len(self.dataset) - self.start_sample
        if self.drop_last:
            return remaining // self.num_replicas
        return math.ceil(remaining / self.num_replicas)


def prepare_loader(loader: Iterable[Any] | None, num_replicas: int, rank: int,
                   seed: int) -> Iterable[Any] | None:
    """Return ``loader`` rebuilt to read this rank's share, resumably.

    A ``DataLoader`` over a map-style dataset with a plain random or sequential sampler gets a
    ``ResumableSampler`` (shuffling as the original did, seeded with ``seed``), also on one
    rank, so that every epoch's order is reproducible and resumable; every other setting is
    kept. Loaders that already split the data, iterable datasets and custom samplers are
    returned unchanged (the last with a warning when there are several ranks: they must split
    the data themselves).
    """
    if loader is None or not isinstance(loader, DataLoader):
        return loader
    if isinstance(loader.dataset, IterableDataset):
        return loader
    if isinstance(loader.sampler, (DistributedSampler, ResumableSampler)) or isinstance(
            getattr(loader.batch_sampler, "sampler", None), DistributedSampler):
        return loader
    custom_batches = loader.batch_sampler is not None and type(loader.batch_sampler) is not BatchSampler
    if custom_batches or type(loader.sampler) not in (RandomSampler, SequentialSampler):
        if num_replicas > 1:
            logger.warning(
                "the DataLoader uses a custom sampler (%s), so dream_trainer cannot split it "
                "across %d data-parallel ranks: make it read a different shard on each rank",
                type(loader.batch_sampler if custom_batches else loader.sampler).__name__,
                num_replicas,
            )
        return loader
    sampler = ResumableSampler(
        loader.dataset, num_replicas=num_replicas, rank=rank,
        shuffle=isinstance(loader.sampler, RandomSampler), seed=seed,
        drop_last=loader.drop_last,
    )
    workers = loader.num_workers
    return DataLoader(
        loader.dataset,
        batch_size=loader.batch_size,
        sampler=sampler,
        num_workers=workers,
        collate_fn=loader.collate_fn,
        pin_memory=loader.pin_memory,
        drop_last=loader.drop_last,
        timeout=loader.timeout,
        worker_init_fn=loader.worker_init_fn,
        multiprocessing_context=loader.multiprocessing_context if workers else None,
        generator=loader.generator,
        prefetch_factor=loader.prefetch_factor if workers else None,
        persistent_workers=loader.persistent_workers,
        pin_memory_device=loader.pin_memory_device,
        in_order=getattr(loader, "in_order", True),
    )


def epoch_batches(loader: Iterable[Any], start: int, stop: int,
                  samples_per_batch: int) -> Iterator[Any]:
    """Batches ``start`` to ``stop`` of this epoch (the iterator is created here).

    With a ``ResumableSampler`` the skipped samples are never loaded. Other loaders are read
    and the first ``start`` batches discarded, which repeats the same batches only if the
    loader's order is deterministic.

    Args:
        samples_per_batch: Samples per batch over all data-parallel ranks.
    """
    if start == 0:
        return itertools.islice(loader, stop)
    sampler = getattr(loader, "sampler", None)
    if isinstance(sampler, ResumableSampler):
        sampler.start_at(start * samples_per_batch)
        return itertools.islice(loader, stop - start)
    logger.warning("resuming mid-epoch by reading and discarding %d batches: this loader has "
                   "no ResumableSampler", start)
    return itertools.islice(loader, start, stop)


def set_sampler_epoch(loader: Iterable[Any], epoch: int) -> None:
    """Call ``set_epoch`` on the loader's sampler(s), so shuffling differs per epoch."""
    batch_sampler = getattr(loader, "batch_sampler", None)
    samplers = {id(s): s for s in (getattr(loader, "sampler", None),
                                   getattr(batch_sampler, "sampler", None)) if s is not None}
    for sampler in samplers.values():
        if hasattr(sampler, "set_epoch"):
            sampler.set_epoch(epoch)


def has_resumable_sampler(loader: Iterable[Any]) -> bool:
    return isinstance(getattr(loader, "sampler", None), ResumableSampler)


def numbered_batches(batches: Iterable[Any], start: int, kind: str) -> Iterator[tuple[int, Any]]:
    """``enumerate`` from ``start`` that names the batch a failing loader was producing."""
    iterator = iter(batches)
    index = start
    while True:
        try:
            batch = next(iterator)
        except StopIteration:
            return
        except Exception as exc:
            if hasattr(exc, "add_note"):
                exc.add_note(f"dream_trainer: raised by the {kind} dataloader while loading "
                             f"batch {index}")
            raise
        yield index, batch
        index += 1
