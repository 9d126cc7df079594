"""Samplers that split a dataset across data-parallel ranks: resumably for training, and
without duplicates for validation."""

from __future__ import annotations

import math
from collections.abc import Iterator, Sized

import torch
from torch.utils.data import Sampler


def epoch_order(n: int, shuffle: bool, seed: int) -> list[int]:
    """The order of one epoch: a permutation seeded by ``seed`` (``DistributedSampler``'s), or
    the natural order."""
    if not shuffle:
        return list(range(n))
    generator = torch.Generator()
    generator.manual_seed(seed)
    return torch.randperm(n, generator=generator).tolist()


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
        order = epoch_order(len(self.dataset), self.shuffle, self.seed + self.epoch)
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


class ValidationBatches(Sampler[list[int]]):
    """This rank's batches of a validation set: every sample read once, by one rank.

    ``DistributedSampler`` pads the set with repeated samples so every rank reads as many;
    those repeats would count twice in metrics and means. Here rank ``r`` reads samples
    ``r, r + R, r + 2R, ...`` of the set (shuffled first if asked), and every rank yields the
    same number of batches, because a sharded model's forward pass is a collective: a rank
    with fewer samples makes some of its last batches smaller instead of repeating any. A
    batch holds at most ``batch_size`` samples, except when there are more batches than some
    rank has samples (``batch_size=1`` and a set that does not split evenly), where a few
    batches of the other ranks hold one sample more.

    Args:
        dataset: The validation set (only its length is used).
        batch_size: Samples per batch.
        num_replicas: Number of data-parallel ranks.
        rank: This rank's index among them.
        drop_last: Leave out the last ``len(dataset) % batch_size`` samples of the set, as one
            process with ``drop_last=True`` would.
        shuffle: Shuffle the set with ``seed`` first.
        seed: Seed of the shuffle.

    Raises:
        ValueError: if the set has fewer samples than there are ranks.
    """

    def __init__(self, dataset: Sized, batch_size: int, num_replicas: int = 1, rank: int = 0,
                 drop_last: bool = False, shuffle: bool = False, seed: int = 0) -> None:
        if not 0 <= rank < num_replicas:
            raise ValueError(f"rank {rank} is outside num_replicas={num_replicas}")
        total = len(dataset) - (len(dataset) % batch_size if drop_last else 0)
        if total < num_replicas:
            raise ValueError(
                f"the validation set has {total} samples to read, fewer than the "
                f"{num_replicas} data-parallel ranks: every rank needs at least one (use a "
                "larger validation set or fewer ranks)"
            )
        self.dataset, self.batch_size = dataset, batch_size
        self.num_replicas, self.rank = num_replicas, rank
        self.shuffle, self.seed, self.total = shuffle, seed, total
        shares = [len(range(r, total, num_replicas)) for r in range(num_replicas)]
        self.num_batches = min(math.ceil(max(shares) / batch_size), min(shares))

    def __iter__(self) -> Iterator[list[int]]:
        mine = epoch_order(len(self.dataset), self.shuffle, self.seed)[:self.total][
            self.rank::self.num_replicas]
        start = 0
        for size in self.batch_sizes(self.rank):
            yield mine[start:start + size]
            start += size

    def batch_sizes(self, rank: int) -> list[int]:
        """The sizes of the batches data-parallel rank ``rank`` reads, in order."""
        share = len(range(rank, self.total, self.num_replicas))
        return _batch_sizes(share, self.num_batches, self.batch_size)

    def __len__(self) -> int:
        return self.num_batches


def _batch_sizes(n: int, batches: int, batch_size: int) -> list[int]:
    """``batches`` sizes summing to ``n``, each at least 1: full batches first, then what is
    left spread so that no batch is empty."""
    sizes = []
    for index in range(batches):
        left, remaining = n - sum(sizes), batches - index
        size = min(batch_size, left - (remaining - 1))
        sizes.append(max(size, math.ceil(left / remaining)))
    return sizes
