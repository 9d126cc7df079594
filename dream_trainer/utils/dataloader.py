"""Giving a user's DataLoader a ``DistributedSampler`` when it has none."""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

from torch.utils.data import (BatchSampler, DataLoader, IterableDataset, RandomSampler,
                              SequentialSampler)
from torch.utils.data.distributed import DistributedSampler

logger = logging.getLogger(__name__)


def distribute_loader(loader: Iterable[Any] | None, num_replicas: int, rank: int,
                      seed: int) -> Iterable[Any] | None:
    """Return ``loader`` rebuilt to read only this rank's share of the data.

    A ``DataLoader`` over a map-style dataset with a plain random or sequential sampler gets a
    ``DistributedSampler`` (shuffling as the original did, seeded with ``seed``); every other
    setting is kept. Loaders that already split the data, iterable datasets and custom
    samplers are returned unchanged, the last with a warning: they must split the data
    themselves.
    """
    if loader is None or num_replicas == 1 or not isinstance(loader, DataLoader):
        return loader
    if isinstance(loader.dataset, IterableDataset):
        return loader
    if isinstance(loader.sampler, DistributedSampler) or isinstance(
            getattr(loader.batch_sampler, "sampler", None), DistributedSampler):
        return loader
    custom_batches = loader.batch_sampler is not None and type(loader.batch_sampler) is not BatchSampler
    if custom_batches or type(loader.sampler) not in (RandomSampler, SequentialSampler):
        logger.warning(
            "the DataLoader uses a custom sampler (%s), so dream_trainer cannot split it across "
            "%d data-parallel ranks: make it read a different shard on each rank",
            type(loader.batch_sampler if custom_batches else loader.sampler).__name__,
            num_replicas,
        )
        return loader
    sampler = DistributedSampler(
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
