"""Preparing a user's loaders for the loop: split across ranks, resumed mid-epoch."""

from __future__ import annotations

import itertools
import logging
from collections.abc import Iterable, Iterator
from typing import Any

from torch.utils.data import (BatchSampler, DataLoader, IterableDataset, RandomSampler,
                              SequentialSampler, default_collate)
from torch.utils.data.distributed import DistributedSampler

from dream_trainer.data.samplers import ResumableSampler, ValidationBatches
from dream_trainer.data.sharded import check_stream_loader, stream_of

logger = logging.getLogger(__name__)


def prepare_loader(loader: Iterable[Any] | None, num_replicas: int, rank: int, seed: int,
                   validation: bool = False) -> Iterable[Any] | None:
    """Return ``loader`` rebuilt to read this rank's share of its dataset.

    A ``DataLoader`` over a map-style dataset with a plain random or sequential sampler (or a
    ``DistributedSampler``, for validation) is rebuilt with every other setting kept:

    - for training, with a ``ResumableSampler`` (shuffling as the original did, seeded with
      ``seed``), also on one rank, so that every epoch's order is reproducible and can resume
      mid-epoch on any number of ranks;
    - for validation, with ``ValidationBatches``: each sample is read once, by one rank, so
      that metrics and means over the ranks equal one process's.

    A loader over a ``ShardedStream`` is kept, and the stream told this rank's share and the
    loader's batch size (its block).
    Loaders that already split the data, iterable datasets and custom samplers are returned
    unchanged (the last with a warning when there are several ranks: they must split the data
    themselves).
    """
    stream = stream_of(loader)
    if stream is not None:
        stream.distribute(num_replicas, rank, check_stream_loader(loader))
        return loader
    if loader is None or not isinstance(loader, DataLoader):
        return loader
    if isinstance(loader.dataset, IterableDataset):
        return loader
    sampler = loader.sampler
    distributed = isinstance(sampler, DistributedSampler) or isinstance(
        getattr(loader.batch_sampler, "sampler", None), DistributedSampler)
    if isinstance(sampler, ResumableSampler) or (distributed and not validation) \
            or isinstance(loader.batch_sampler, ValidationBatches):
        return loader  # split already
    # A batch_sampler given to the DataLoader (batch_size is then None) is the user's own
    # batching, even a plain BatchSampler: it is left as it is.
    custom_batches = loader.batch_sampler is not None and (
        type(loader.batch_sampler) is not BatchSampler or loader.batch_size is None)
    plain = (RandomSampler, SequentialSampler, DistributedSampler) if validation \
        else (RandomSampler, SequentialSampler)
    if custom_batches or type(sampler) not in plain:
        if num_replicas > 1:
            logger.warning(
                "the DataLoader uses a custom sampler (%s), so dream_trainer cannot split it "
                "across %d data-parallel ranks: make it read a different shard on each rank",
                type(loader.batch_sampler if custom_batches else sampler).__name__,
                num_replicas,
            )
        return loader
    shuffle = isinstance(sampler, RandomSampler) or bool(getattr(sampler, "shuffle", False))
    if validation:
        assert loader.batch_size is not None  # a plain BatchSampler has one
        batches = ValidationBatches(loader.dataset, loader.batch_size, num_replicas, rank,
                                    drop_last=loader.drop_last, shuffle=shuffle, seed=seed)
        return _rebuilt(loader, batch_sampler=batches)
    return _rebuilt(loader, batch_size=loader.batch_size, drop_last=loader.drop_last,
                    sampler=ResumableSampler(loader.dataset, num_replicas=num_replicas,
                                             rank=rank, shuffle=shuffle, seed=seed,
                                             drop_last=loader.drop_last))


def _rebuilt(loader: DataLoader[Any], **splitting: Any) -> DataLoader[Any]:
    """A ``DataLoader`` like ``loader`` (same class and settings) that splits its data as
    ``splitting`` says (``sampler`` and ``batch_size``, or ``batch_sampler``)."""
    workers = loader.num_workers
    return type(loader)(
        loader.dataset,
        num_workers=workers,
        collate_fn=loader.collate_fn,
        pin_memory=loader.pin_memory,
        timeout=loader.timeout,
        worker_init_fn=loader.worker_init_fn,
        multiprocessing_context=loader.multiprocessing_context if workers else None,
        generator=loader.generator,
        prefetch_factor=loader.prefetch_factor if workers else None,
        persistent_workers=loader.persistent_workers,
        pin_memory_device=loader.pin_memory_device,
        in_order=getattr(loader, "in_order", True),
        **splitting,
    )


def pipeline_split_problem(loader: Iterable[Any], kind: str, microbatches: int,
                           max_batches: int | None = None) -> str | None:
    """Why a validation loader will yield a batch that a pipeline cannot cut into
    ``microbatches`` equal slices, or None when every batch splits.

    Only a loader that ``prepare_loader`` split with ``ValidationBatches`` and that collates
    with torch's ``default_collate`` is judged: its batches' first dimension is known on
    every rank alike. Others' (a custom sampler, an iterable dataset, a collate function that
    may pack or pad rows) are known only by reading them, which the pipeline checks batch by
    batch.

    Args:
        loader: The loader as ``prepare_loader`` returned it.
        kind: How the message names the loader (``"validation"``, ``"validation 'test'"``).
        microbatches: The pipeline's microbatches per batch.
        max_batches: How many batches of a pass are read; ``None`` reads them all.
    """
    batches = getattr(loader, "batch_sampler", None)
    if not isinstance(batches, ValidationBatches) \
            or getattr(loader, "collate_fn", None) is not default_collate:
        return None
    batch_size, ranks = batches.batch_size, batches.num_replicas
    sizes = sorted({size for rank in range(ranks)
                    for size in batches.batch_sizes(rank)[:max_batches]})
    bad = [size for size in sizes if size % microbatches]
    if not bad:
        return None
    fixes = [f"give the loader a batch_size that is a multiple of {microbatches}"] \
        if batch_size % microbatches else []
    if bad != [batch_size]:  # short batches: the set does not fill every rank's batches
        whole = len(batches.dataset)  # type: ignore[arg-type]
        trimmed = whole - whole % batch_size
        if batches.total == whole and trimmed % (batch_size * ranks) == 0:
            fixes.append(f"build it with drop_last=True (which leaves out the last "
                         f"{whole - trimmed} samples of the set)")
        else:
            fixes.append(f"give the set a multiple of {batch_size * ranks} samples (batch_size "
                         f"x {ranks} data-parallel ranks), so that every rank reads full batches")
    return (f"the {kind} loader yields batches of {', '.join(map(str, sizes))} samples "
            f"(batch_size={batch_size}, {batches.total} samples over {ranks} data-parallel "
            f"rank{'s' if ranks > 1 else ''}), and a pipeline cuts every batch into "
            f"pipeline_microbatches={microbatches} equal slices, so its batches of "
            f"{', '.join(map(str, bad))} samples cannot run: {'; and '.join(fixes)}")


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
