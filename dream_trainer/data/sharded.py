"""A stream whose position is global: it resumes on any number of ranks and loader workers.

``ShardedStream`` reads an indexable source (a list, a map-style dataset, a Hugging Face
``datasets.Dataset`` over local files) as one endless sequence of *positions*: position ``g``
is item ``order(g // N)[g % N]`` of pass ``g // N`` (a fresh permutation each pass when
shuffling). The positions not yet read form a *work list*; a run with ``S`` reading slots (one
per loader worker of each data-parallel rank) deals it round-robin: slot ``s`` reads work items
``s, s + S, s + 2S, ...``.

What a slot has read is two numbers (items finished, tokens read of the next one), so what every
slot has read together, merged, is a set of positions: the ``Progress``. It does not depend on
how many slots read it, which is what lets a run continue on another number of ranks or
workers: the positions left over (and the unread rest of items cut mid-way by token packing)
are dealt to the new slots, and every remaining item is read exactly once.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils.data import IterableDataset, get_worker_info

Interval = tuple[int, int]


@dataclass
class Progress:
    """The positions of a stream read so far, over every rank and worker.

    Attributes:
        consumed: Sorted, disjoint ``[start, stop)`` ranges of positions read whole.
        partial: Positions read in part (token packing), by tokens read.
    """

    consumed: list[Interval] = field(default_factory=list)
    partial: dict[int, int] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return {"consumed": [list(interval) for interval in self.consumed],
                "partial": sorted([position, read] for position, read in self.partial.items())}

    @classmethod
    def from_dict(cls, state: Mapping[str, Any]) -> Progress:
        return cls([(int(a), int(b)) for a, b in state["consumed"]],
                   {int(position): int(read) for position, read in state["partial"]})

    def fragments(self) -> list[tuple[int, int]]:
        """The work list's head: each partly read position and the tokens already read."""
        return sorted(self.partial.items())

    def fresh(self, index: int) -> Iterator[int]:
        """The unread positions (neither consumed nor partial), from the ``index``-th on."""
        excluded = _merged(self.consumed + [(p, p + 1) for p in self.partial])
        position, cursor = 0, 0
        # Jump over the excluded ranges until the index-th unread position is in sight.
        while cursor < len(excluded) and index >= excluded[cursor][0] - position:
            index -= excluded[cursor][0] - position
            position = excluded[cursor][1]
            cursor += 1
        position += index
        while True:
            if cursor < len(excluded) and position >= excluded[cursor][0]:
                position = excluded[cursor][1]
                cursor += 1
                continue
            yield position
            position += 1

    def work(self) -> Iterator[tuple[int, int]]:
        """The work list: ``(position, tokens already read)``, partly read positions first."""
        yield from self.fragments()
        for position in self.fresh(0):
            yield position, 0


def _merged(intervals: list[Interval]) -> list[Interval]:
    merged: list[Interval] = []
    for start, stop in sorted(intervals):
        if start >= stop:
            continue
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], stop))
        else:
            merged.append((start, stop))
    return merged


def merge_progress(pieces: Sequence[Mapping[str, Any]]) -> Progress:
    """The global ``Progress`` after the slots' reads, from every rank's piece.

    Args:
        pieces: What each data-parallel rank saved (``ShardedStream.piece``): the progress
            its slots started from, the number of slots and each of its slots' reads.

    Raises:
        ValueError: if the pieces do not describe one run (different starting progress or
            slot counts, a slot missing or given twice).
    """
    if not pieces:
        raise ValueError("no stream positions to merge")
    base, slots = pieces[0]["progress"], int(pieces[0]["slots"])
    reads: dict[int, tuple[int, int]] = {}
    for piece in pieces:
        if piece["progress"] != base or int(piece["slots"]) != slots:
            raise ValueError("the saved stream positions come from different runs (their "
                             "starting positions or slot counts differ)")
        for slot, taken, offset in piece["reads"]:
            if slot in reads:
                raise ValueError(f"stream slot {slot} was saved twice")
            reads[int(slot)] = (int(taken), int(offset))
    missing = sorted(set(range(slots)) - set(reads))
    if missing:
        raise ValueError(f"the saved stream positions lack slots {missing} of {slots}")
    return _advance(Progress.from_dict(base), slots, reads)


def _advance(base: Progress, slots: int, reads: Mapping[int, tuple[int, int]]) -> Progress:
    """``base`` after slot ``s`` of ``slots`` finished ``reads[s][0]`` work items and read
    ``reads[s][1]`` tokens of its next one."""
    # Work items below `whole` are finished (every slot is past them); above it, a slot that
    # read further finished its own few. The partly read item of a slot is its next one.
    whole = min(slot + taken * slots for slot, (taken, _) in reads.items())
    finished = {slot + step * slots for slot, (taken, _) in reads.items()
                for step in range(max(0, (whole - slot + slots - 1) // slots), taken)}
    started = {slot + taken * slots: offset for slot, (taken, offset) in reads.items() if offset}
    fragments = base.fragments()
    head = len(fragments)

    def fresh_position(index: int) -> int:
        return next(base.fresh(index))

    consumed = list(base.consumed)
    partial: dict[int, int] = {}
    for index, (position, read) in enumerate(fragments):
        if index < whole or index in finished:
            consumed.append((position, position + 1))
        else:
            partial[position] = read + started.get(index, 0)
    if whole > head:
        # Every unread position below the first unfinished fresh one is finished, so the range
        # below it is consumed but for the fragments still being read.
        bound = fresh_position(whole - head)
        cuts = sorted(p for p in partial if p < bound)
        start = 0
        for cut in cuts:
            consumed.append((start, cut))
            start = cut + 1
        consumed.append((start, bound))
    for index in finished:
        if index >= head:
            position = fresh_position(index - head)
            consumed.append((position, position + 1))
    for index, offset in started.items():
        if index >= head:
            partial[fresh_position(index - head)] = offset
    return Progress(_merged(consumed), partial)


class ShardedStream(IterableDataset[Any]):
    """An endless stream over ``source`` whose checkpointed position is global.

    Each data-parallel rank (set by ``distribute``; the trainer calls it) and each loader
    worker reads its own slot of the stream. Without workers the position is the stream's own;
    with workers, read the stream through torchdata's ``StatefulDataLoader``, which keeps each
    worker's position with the batches it returns. The trainer saves each rank's slots and
    merges them on resume, on any number of ranks and workers (``merge_progress``).

    With ``sequence_length`` the stream packs tokens: the items' tokens (``tokens(item)``,
    by default ``item["input_ids"]`` or the item itself) are concatenated and cut into
    ``LongTensor``s of ``sequence_length`` tokens; an item cut at a checkpoint continues from
    the token where it was cut.

    Args:
        source: Any object with ``len()`` and integer indexing.
        shuffle: Read each pass in a new random order (seeded by ``seed`` and the pass).
        seed: The shuffling seed.
        sequence_length: Pack tokens into sequences of this length (None: yield items).
        tokens: An item's token ids, when packing.
        transform: Applied to each item when not packing.

    Raises:
        ValueError: for an empty source or a sequence length below 1.
    """

    def __init__(self, source: Any, *, shuffle: bool = True, seed: int = 0,
                 sequence_length: int | None = None,
                 tokens: Callable[[Any], Sequence[int]] | None = None,
                 transform: Callable[[Any], Any] | None = None) -> None:
        if len(source) == 0:
            raise ValueError("ShardedStream needs a non-empty source")
        if sequence_length is not None and sequence_length < 1:
            raise ValueError(f"sequence_length={sequence_length} must be at least 1")
        self.source = source
        self.shuffle = shuffle
        self.seed = seed
        self.sequence_length = sequence_length
        self.tokens = tokens or _default_tokens
        self.transform = transform
        self.num_replicas, self.rank = 1, 0
        self.progress = Progress()
        self._read: tuple[int, int, int, int] | None = None  # slot, slots, taken, offset

    def distribute(self, num_replicas: int, rank: int) -> None:
        """Read the share of data-parallel rank ``rank`` of ``num_replicas``.

        Raises:
            ValueError: for a rank outside ``[0, num_replicas)``.
        """
        if not 0 <= rank < num_replicas:
            raise ValueError(f"rank {rank} is not in [0, {num_replicas})")
        self.num_replicas, self.rank = num_replicas, rank

    def item(self, position: int) -> Any:
        """The source item at stream position ``position``."""
        return _Items(self)[position]

    def __iter__(self) -> Iterator[Any]:
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        slot, slots = self.rank * workers + worker, self.num_replicas * workers
        self._read = (slot, slots, 0, 0)
        mine = itertools.islice(self.progress.work(), slot, None, slots)
        items = _Items(self)
        if self.sequence_length is None:
            for taken, (position, _) in enumerate(mine):
                self._read = (slot, slots, taken + 1, 0)
                value = items[position]
                yield value if self.transform is None else self.transform(value)
        else:
            yield from self._packed(mine, items, slot, slots)

    def _packed(self, mine: Iterator[tuple[int, int]], items: _Items, slot: int,
                slots: int) -> Iterator[torch.Tensor]:
        assert self.sequence_length is not None
        length = self.sequence_length
        buffer: list[int] = []
        for taken, (position, skip) in enumerate(mine):
            ids = list(self.tokens(items[position]))[skip:]
            read = 0
            while read < len(ids):
                piece = ids[read:read + length - len(buffer)]
                buffer.extend(piece)
                read += len(piece)
                if len(buffer) == length:
                    # The position a checkpoint sees is the next token to read.
                    self._read = (slot, slots, taken + 1, 0) if read == len(ids) \
                        else (slot, slots, taken, read)
                    yield torch.tensor(buffer, dtype=torch.long)
                    buffer = []

    # -- position ---------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """This process's reads (the slot it reads, items finished, tokens read of the next);
        what a ``StatefulDataLoader`` keeps for each worker."""
        if self._read is None:
            return {"read": None}
        return {"read": list(self._read)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Refused: one slot's reads mean nothing without the others'.

        Raises:
            ValueError: always, naming ``merge_progress`` and ``resume``.
        """
        raise ValueError(
            "a ShardedStream does not resume one worker's saved reads alone: merge every "
            "rank's piece with dream_trainer.data.sharded.merge_progress and call "
            "stream.resume(progress) before iterating (the trainer does both on resume)"
        )

    def resume(self, progress: Progress) -> None:
        """Continue after ``progress``: the next iteration deals the unread positions."""
        self.progress = progress
        self._read = None

    def piece(self, reads: Sequence[Mapping[str, Any] | None], workers: int) -> dict[str, Any]:
        """This rank's share of the global position, from its workers' ``state_dict()``s (in
        worker order; None or ``{"read": None}`` for a worker that has read nothing)."""
        slots = self.num_replicas * max(workers, 1)
        saved = []
        for worker, state in enumerate(reads):
            read = None if state is None else state.get("read")
            slot = self.rank * max(workers, 1) + worker
            if read is None:
                saved.append([slot, 0, 0])
            else:
                if int(read[1]) != slots or int(read[0]) != slot:
                    raise ValueError(f"worker {worker}'s stream position belongs to slot "
                                     f"{read[0]} of {read[1]}, not {slot} of {slots}")
                saved.append([slot, int(read[2]), int(read[3])])
        return {"progress": self.progress.as_dict(), "slots": slots, "reads": saved}


class _Items:
    """Items by position, with one pass's permutation cached."""

    def __init__(self, stream: ShardedStream) -> None:
        self.stream = stream
        self.size = len(stream.source)
        self.step: int | None = None
        self.order: torch.Tensor | None = None

    def __getitem__(self, position: int) -> Any:
        step, index = divmod(position, self.size)
        if not self.stream.shuffle:
            return self.stream.source[index]
        if step != self.step:
            generator = torch.Generator().manual_seed(self.stream.seed * 1_000_003 + step)
            self.order, self.step = torch.randperm(self.size, generator=generator), step
        assert self.order is not None
        return self.stream.source[int(self.order[index])]


def _default_tokens(item: Any) -> Sequence[int]:
    if isinstance(item, Mapping):
        return item["input_ids"]
    if isinstance(item, torch.Tensor):
        return item.tolist()
    return item


def stream_of(loader: Any) -> ShardedStream | None:
    """The ``ShardedStream`` ``loader`` reads, or None."""
    dataset = getattr(loader, "dataset", None)
    return dataset if isinstance(dataset, ShardedStream) else None


def loader_piece(loader: Any, stream: ShardedStream) -> dict[str, Any]:
    """This rank's share of the stream's global position, as of the batches ``loader`` has
    returned (a ``StatefulDataLoader`` keeps each worker's ``state_dict()`` with the batches
    it returns; without workers the stream's own is current)."""
    workers = int(getattr(loader, "num_workers", 0))
    if not workers:
        return stream.piece([stream.state_dict()], 0)
    snapshots = loader.state_dict().get("_snapshot", {}).get("_worker_snapshots", {})
    reads = [snapshots.get(f"worker_{worker}", {}).get("dataset_state")
             for worker in range(workers)]
    return stream.piece(reads, workers)


def check_stream_loader(loader: Any) -> None:
    """Refuse a loader whose workers' positions cannot be known.

    Raises:
        ValueError: for worker processes under a loader without ``state_dict()``.
    """
    if int(getattr(loader, "num_workers", 0)) and not callable(getattr(loader, "state_dict",
                                                                       None)):
        raise ValueError(
            f"a ShardedStream read by {type(loader).__name__} with num_workers="
            f"{loader.num_workers}: a plain DataLoader does not say what each worker has "
            "returned, so the stream's position could not be saved. Read it through "
            "torchdata's StatefulDataLoader (same arguments), or with num_workers=0"
        )
