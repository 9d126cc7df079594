"""A stream in one global sample order: every layout reads the same samples, and a resume
continues that order on any number of ranks and loader workers.

``ShardedStream`` numbers its samples ``0, 1, 2, ...`` (*positions*). Without packing, sample
``g`` is item ``order_p[g % N]`` of pass ``p = g // N`` (``order_p`` a fresh permutation each
pass when shuffling); packed into sequences of ``L`` tokens, sample ``g`` is tokens
``[g L, (g + 1) L)`` of the items' tokens concatenated in pass order, pass after pass, found
through the items' lengths (``length_index``). The order depends on the source, the seed and
the pass, nothing else.

The positions not yet read, in order, are the *work list*. Its blocks of ``B`` samples (``B``
the micro-batch size) are dealt round-robin to the ``S = R x W`` reading *slots*, slot
``w R + r`` being loader worker ``w`` of data-parallel rank ``r``. A loader that takes its
workers' batches in turn then hands rank ``r`` block ``j R + r`` as its ``j``-th micro-batch:
micro-step ``j`` of all ranks together holds work-list samples ``[j R B, (j + 1) R B)``,
whatever ``R`` and ``W`` are, so a global batch holds the same samples on every layout.

What a slot has read is one number, the samples it yielded; the reads of every slot, merged,
are a set of positions (``Progress``) that does not depend on how many slots read them. A
resume deals the work list left to the new run's slots: on the same layout it continues
bit-exactly, on another one it reads every remaining sample once, in the global order.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils.data import IterableDataset, get_worker_info

from dream_trainer.data.documents import LongDocuments, Piece, assemble, checked_labels
from dream_trainer.data.length_index import default_tokens, length_index

Interval = tuple[int, int]
# What ``ShardedStream.piece`` writes; positions of another format meant other samples.
FORMAT = 2


@dataclass
class Progress:
    """The positions of a stream read so far, over every rank and worker.

    Attributes:
        consumed: Sorted, disjoint ``[start, stop)`` ranges of positions read.
    """

    consumed: list[Interval] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return {"consumed": [list(interval) for interval in self.consumed]}

    @classmethod
    def from_dict(cls, state: Mapping[str, Any]) -> Progress:
        return cls(_merged([(int(a), int(b)) for a, b in state["consumed"]]))

    def unread(self, start: int, stop: int) -> list[Interval]:
        """The positions of work-list entries ``[start, stop)`` (the unread positions in
        order, numbered from 0), as ranges."""
        ranges: list[Interval] = []
        position = index = 0  # the unread position `position` is work-list entry `index`
        for consumed_start, consumed_stop in self.consumed:
            gap = consumed_start - position
            low, high = max(start, index), min(stop, index + gap)
            if low < high:
                ranges.append((position + low - index, position + high - index))
            index += gap
            position = consumed_stop
            if index >= stop:
                return ranges
        low = max(start, index)
        if low < stop:
            ranges.append((position + low - index, position + stop - index))
        return ranges


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
            its slots started from, the slots, the block size and each slot's reads.

    Raises:
        ValueError: if the pieces do not describe one run (different starting progress,
            slot counts or block sizes, a slot missing or given twice), or were written
            before streams had one global order.
    """
    if not pieces:
        raise ValueError("no stream positions to merge")
    if any(piece.get("format") != FORMAT for piece in pieces):
        raise ValueError(
            "the checkpoint's ShardedStream position was written before streams had one "
            "global sample order (its packed samples depended on the layout, so its "
            "positions name other samples): resume it with the dream_trainer that wrote it, "
            "or start a new run from its weights (init_weights_from)"
        )
    first = pieces[0]
    base, slots, block = first["progress"], int(first["slots"]), int(first["batch_size"])
    reads: dict[int, int] = {}
    for piece in pieces:
        if (piece["progress"], int(piece["slots"]), int(piece["batch_size"])) \
                != (base, slots, block):
            raise ValueError("the saved stream positions come from different runs (their "
                             "starting positions, slot counts or batch sizes differ)")
        for slot, yielded in piece["reads"]:
            if slot in reads:
                raise ValueError(f"stream slot {slot} was saved twice")
            reads[int(slot)] = int(yielded)
    missing = sorted(set(range(slots)) - set(reads))
    if missing:
        raise ValueError(f"the saved stream positions lack slots {missing} of {slots}")
    return _advance(Progress.from_dict(base), slots, block, reads)


def _advance(base: Progress, slots: int, block: int, reads: Mapping[int, int]) -> Progress:
    """``base`` after slot ``s`` of ``slots`` yielded ``reads[s]`` samples of its blocks
    (blocks ``s, s + slots, ...`` of ``block`` work-list entries each)."""
    # Every slot finished its first `whole` blocks: the work list below them is read. Past
    # them, each slot read a few blocks (at most one in part) of its own.
    whole = min(yielded // block for yielded in reads.values())
    entries = [(0, whole * slots * block)]
    for slot, yielded in reads.items():
        for turn in range(whole, yielded // block + 1):
            start = (turn * slots + slot) * block
            entries.append((start, start + min(block, yielded - turn * block)))
    read = [span for start, stop in entries if start < stop
            for span in base.unread(start, stop)]
    return Progress(_merged(base.consumed + read))


class ShardedStream(IterableDataset[Any]):
    """An endless stream over ``source`` in one global sample order, with a global position.

    Every data-parallel rank (set by ``distribute``; the trainer calls it) and loader worker
    reads its own blocks of that order. Without workers the position is the stream's own;
    with workers, read the stream through torchdata's ``StatefulDataLoader``, which keeps each
    worker's position with the batches it returns. The trainer saves each rank's reads and
    merges them on resume, on any number of ranks and workers (``merge_progress``).

    With ``sequence_length`` the stream packs tokens: the items' tokens (``tokens(item)``, by
    default ``item["input_ids"]`` or the item itself), concatenated in the pass's order, are
    cut into ``LongTensor``s of ``sequence_length`` tokens. The items' lengths are found once
    (``lengths``, ``index_cache``) so that any sample can be read without the ones before it.
    With ``documents=True`` each item stays a document of its own: a sample is a dict of
    ``input_ids``, ``position_ids`` (restarting at 0 in each document), ``document_ids``
    (0, 1, ... for the documents of the sample) and ``targets`` (the next token's label within
    the document, -100 at its end), see ``dream_trainer.data.documents``; the global order,
    the positions and resume are those of plain packing.

    Args:
        source: Any object with ``len()`` and integer indexing.
        shuffle: Read each pass in a new random order (seeded by ``seed`` and the pass).
        seed: The shuffling seed.
        sequence_length: Pack tokens into sequences of this length (None: yield items).
        tokens: An item's token ids, when packing.
        transform: Applied to each item when not packing.
        lengths: When packing, every item's token count, or the name of the source's column
            holding them; None finds them (see ``length_index``).
        index_cache: A file for the lengths found: read when it matches the source.
        documents: Pack items as documents that never see each other (see above).
        labels: With ``documents``, an item's labels, one per token (unshifted; -100 where
            not trained, as for the system and user turns of a conversation); by default
            its tokens.
        long_documents: With ``documents``, a document longer than ``sequence_length`` is
            ``"split"`` over samples (its positions continue; each piece attends to itself
            alone) or ``"truncate"``d to ``sequence_length`` tokens (the rest is never read,
            and its last kept token has no target).

    Raises:
        ValueError: for an empty source, a sequence length below 1, a source without
            tokens, ``lengths``/``index_cache`` without packing, or ``documents`` options
            without ``documents``.
    """

    def __init__(self, source: Any, *, shuffle: bool = True, seed: int = 0,
                 sequence_length: int | None = None,
                 tokens: Callable[[Any], Sequence[int]] | None = None,
                 transform: Callable[[Any], Any] | None = None,
                 lengths: Sequence[int] | str | None = None,
                 index_cache: str | os.PathLike[str] | None = None,
                 documents: bool = False,
                 labels: Callable[[Any], Sequence[int]] | None = None,
                 long_documents: LongDocuments = "split") -> None:
        if len(source) == 0:
            raise ValueError("ShardedStream needs a non-empty source")
        if sequence_length is not None and sequence_length < 1:
            raise ValueError(f"sequence_length={sequence_length} must be at least 1")
        if sequence_length is None and (lengths is not None or index_cache is not None):
            raise ValueError("lengths and index_cache are the token counts packing needs: "
                             "give sequence_length too, or leave them out")
        if documents and sequence_length is None:
            raise ValueError("documents=True packs items as documents into sequences: give "
                             "sequence_length too")
        if not documents and (labels is not None or long_documents != "split"):
            raise ValueError("labels and long_documents describe packed documents: give "
                             "documents=True too, or leave them out")
        if long_documents not in ("split", "truncate"):
            raise ValueError(f"long_documents={long_documents!r}: give 'split' or 'truncate'")
        self.source = source
        self.shuffle = shuffle
        self.seed = seed
        self.sequence_length = sequence_length
        self.tokens = tokens or default_tokens
        self.transform = transform
        self.documents = documents
        self.labels = labels
        self.long_documents = long_documents
        self.item_lengths = None if sequence_length is None \
            else length_index(source, tokens, lengths, index_cache)
        # Truncated documents take at most a sequence each in the token order.
        self.lengths = self.item_lengths if self.item_lengths is None \
            or long_documents == "split" else self.item_lengths.clamp(max=sequence_length)
        self.total_tokens = 0 if self.lengths is None else int(self.lengths.sum())
        if self.lengths is not None and self.total_tokens == 0:
            raise ValueError("the source has no tokens to pack: every item's token count "
                             "is 0")
        self.num_replicas, self.rank, self.batch_size = 1, 0, 1
        self.progress = Progress()
        self._read: tuple[int, int, int] | None = None  # slot, slots, samples yielded

    def distribute(self, num_replicas: int, rank: int, batch_size: int = 1) -> None:
        """Read the share of data-parallel rank ``rank`` of ``num_replicas``, in blocks of
        ``batch_size`` samples (the loader's micro-batch).

        Raises:
            ValueError: for a rank outside ``[0, num_replicas)`` or a batch size below 1.
        """
        if not 0 <= rank < num_replicas:
            raise ValueError(f"rank {rank} is not in [0, {num_replicas})")
        if batch_size < 1:
            raise ValueError(f"batch_size={batch_size} must be at least 1")
        self.num_replicas, self.rank, self.batch_size = num_replicas, rank, batch_size

    def sample(self, position: int) -> Any:
        """The sample at stream position ``position`` (what the stream yields there)."""
        return _Samples(self)[position]

    def __iter__(self) -> Iterator[Any]:
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        slot, slots = worker * self.num_replicas + self.rank, self.num_replicas * workers
        self._read = (slot, slots, 0)
        samples, size, yielded = _Samples(self), self.batch_size, 0
        for block in range(slot, 2**62, slots):
            for start, stop in self.progress.unread(block * size, (block + 1) * size):
                for position in range(start, stop):
                    value = samples[position]
                    yielded += 1
                    # The position a checkpoint sees is after this sample.
                    self._read = (slot, slots, yielded)
                    yield value

    # -- position ---------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """This process's reads (its slot, the slot count, samples yielded); what a
        ``StatefulDataLoader`` keeps for each worker."""
        return {"read": None if self._read is None else list(self._read)}

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
        worker order; None or ``{"read": None}`` for a worker that has read nothing).

        Raises:
            ValueError: for a worker's reads that belong to another slot.
        """
        workers = max(workers, 1)
        slots = self.num_replicas * workers
        saved = []
        for worker, state in enumerate(reads):
            read = None if state is None else state.get("read")
            slot = worker * self.num_replicas + self.rank
            if read is not None and (int(read[0]), int(read[1])) != (slot, slots):
                raise ValueError(f"worker {worker}'s stream position belongs to slot "
                                 f"{read[0]} of {read[1]}, not {slot} of {slots}")
            saved.append([slot, 0 if read is None else int(read[2])])
        return {"format": FORMAT, "progress": self.progress.as_dict(), "slots": slots,
                "batch_size": self.batch_size, "reads": saved}


class _Samples:
    """Samples by position, with the current pass's order (and token offsets) cached."""

    def __init__(self, stream: ShardedStream) -> None:
        self.stream = stream
        self.size = len(stream.source)
        self.total = stream.total_tokens
        self.pass_index: int | None = None
        self.order = self.ends = torch.empty(0, dtype=torch.int64)
        # The item read last: its index, tokens and labels.
        self.document: tuple[int, list[int], list[int]] | None = None

    def __getitem__(self, position: int) -> Any:
        if self.stream.sequence_length is None:
            step, index = divmod(position, self.size)
            value = self.stream.source[self._item(step, index)]
            return value if self.stream.transform is None else self.stream.transform(value)
        return self._packed(position * self.stream.sequence_length)

    def _item(self, step: int, index: int) -> int:
        if not self.stream.shuffle:
            return index
        self._load_pass(step)
        return int(self.order[index])

    def _load_pass(self, step: int) -> None:
        if step == self.pass_index:
            return
        if self.stream.shuffle:
            generator = torch.Generator().manual_seed(self.stream.seed * 1_000_003 + step)
            self.order = torch.randperm(self.size, generator=generator)
        else:
            self.order = torch.arange(self.size)
        if self.stream.lengths is not None:
            self.ends = torch.cumsum(self.stream.lengths[self.order], 0)
        self.pass_index = step

    def _packed(self, token: int) -> Any:
        length = self.stream.sequence_length
        assert length is not None
        pieces: list[Piece] = []
        filled = 0
        while filled < length:
            step, offset = divmod(token + filled, self.total)
            self._load_pass(step)
            # The item holding the pass's `offset`-th token: the first whose end is past it.
            index = int(torch.searchsorted(self.ends, offset, right=True))
            begin = int(self.ends[index - 1]) if index else 0
            ids, labels = self._document(int(self.order[index]))
            start = offset - begin
            stop = min(len(ids), start + length - filled)
            pieces.append(Piece(ids, labels, start, stop))
            filled += stop - start
        if self.stream.documents:
            return assemble(pieces)
        return torch.tensor([token for piece in pieces
                             for token in piece.tokens[piece.start:piece.stop]],
                            dtype=torch.long)

    def _document(self, item: int) -> tuple[list[int], list[int]]:
        """Item ``item``'s tokens and labels, truncated as the stream packs them."""
        if self.document is None or self.document[0] != item:
            stream = self.stream
            value = stream.source[item]
            ids = list(stream.tokens(value))
            assert stream.item_lengths is not None and stream.sequence_length is not None
            if len(ids) != int(stream.item_lengths[item]):
                raise ValueError(
                    f"item {item} has {len(ids)} tokens but the length index says "
                    f"{int(stream.item_lengths[item])}: the index does not describe this "
                    "source (delete the index_cache file, or fix the lengths given)")
            labels = ids if stream.labels is None \
                else checked_labels(item, ids, stream.labels(value))
            if stream.long_documents == "truncate":
                ids, labels = ids[:stream.sequence_length], labels[:stream.sequence_length]
            self.document = (item, ids, labels)
        return self.document[1], self.document[2]


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


def check_stream_loader(loader: Any) -> int:
    """The micro-batch size of a loader over a ``ShardedStream``, once it is known that the
    loader returns the stream's blocks in the global order.

    Raises:
        ValueError: for worker processes under a loader without ``state_dict()``, workers
            taken out of turn (``in_order=False``), or no ``batch_size``.
    """
    name = type(loader).__name__
    workers = int(getattr(loader, "num_workers", 0))
    if workers and not callable(getattr(loader, "state_dict", None)):
        raise ValueError(
            f"a ShardedStream read by {name} with num_workers={workers}: a plain DataLoader "
            "does not say what each worker has returned, so the stream's position could not "
            "be saved. Read it through torchdata's StatefulDataLoader (same arguments), or "
            "with num_workers=0"
        )
    if workers and getattr(loader, "in_order", True) is False:
        raise ValueError(
            f"a ShardedStream read by {name} with in_order=False: batches taken from "
            "whichever worker is ready leave the global sample order; keep in_order=True"
        )
    batch_size = getattr(loader, "batch_size", None)
    if not isinstance(batch_size, int):
        raise ValueError(
            f"a ShardedStream read by {name} without a batch_size: the stream deals its "
            "samples in blocks of the micro-batch, so give the loader batch_size"
        )
    return batch_size
