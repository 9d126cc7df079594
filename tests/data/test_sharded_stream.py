"""ShardedStream in one process: one global sample order, whatever the ranks, workers and
micro-batch; resumes that continue it exactly on the same layout and read every remaining
sample once, in order, on another; the length index packing reads from."""

from __future__ import annotations

import copy
import random
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader

from dream_trainer.data import ShardedStream, sharded
from dream_trainer.data.sharded import (Progress, check_stream_loader, loader_piece,
                                        merge_progress)
from tests.helpers.sharded import documents

SEQUENCE = 5


def packed(shuffle: bool = True) -> ShardedStream:
    return ShardedStream(documents(), seed=3, shuffle=shuffle, sequence_length=SEQUENCE)


def items(shuffle: bool = True) -> ShardedStream:
    return ShardedStream(list(range(40)), seed=3, shuffle=shuffle)


STREAMS: dict[str, Callable[[], ShardedStream]] = {
    "packed, shuffled": packed, "packed, in order": lambda: packed(False),
    "items, shuffled": items,
}


def key(sample: Any) -> Any:
    return tuple(sample.tolist()) if isinstance(sample, torch.Tensor) else sample


class Layout:
    """``ranks`` data-parallel ranks with ``workers`` loader workers each, reading micro-batches
    of ``batch`` as a loader does: rank r's j-th micro-batch is the next ``batch`` samples of
    worker ``j % workers`` (worker processes are stood in for by their worker info)."""

    def __init__(self, make: Callable[[], ShardedStream], ranks: int, workers: int, batch: int,
                 progress: Progress, monkeypatch: pytest.MonkeyPatch) -> None:
        self.ranks, self.workers, self.batch = ranks, workers, batch
        self.streams: list[list[ShardedStream]] = []
        self.iterators: list[list[Iterator[Any]]] = []
        self.pending: list[list[list[Any]]] = []
        self.micro = [0] * ranks
        worker_info: list[Any] = [None]
        monkeypatch.setattr(sharded, "get_worker_info", lambda: worker_info[0])
        for rank in range(ranks):
            self.streams.append([])
            self.iterators.append([])
            self.pending.append([])
            for worker in range(workers):
                stream = make()
                stream.distribute(ranks, rank, batch)
                stream.resume(copy.deepcopy(progress))
                worker_info[0] = SimpleNamespace(id=worker, num_workers=workers) \
                    if workers > 1 else None
                iterator = iter(stream)
                self.pending[rank].append([next(iterator)])  # the worker info is read here
                self.streams[rank].append(stream)
                self.iterators[rank].append(iterator)

    def micro_batch(self, rank: int) -> list[Any]:
        worker = self.micro[rank] % self.workers
        self.micro[rank] += 1
        taken, self.pending[rank][worker] = self.pending[rank][worker], []
        while len(taken) < self.batch:
            taken.append(next(self.iterators[rank][worker]))
        return taken

    def global_batches(self, steps: int, accumulation: int = 1) -> list[list[Any]]:
        """Each step's samples, micro-steps in order and ranks in order within each."""
        return [[key(sample) for _ in range(accumulation) for rank in range(self.ranks)
                 for sample in self.micro_batch(rank)] for _ in range(steps)]

    def pieces(self) -> list[dict[str, Any]]:
        if self.workers == 1:
            return [streams[0].piece([streams[0].state_dict()], 0) for streams in self.streams]
        # A worker whose next block was read ahead (pending) has yielded that sample already;
        # a loader's snapshot is as of the batches it returned, which is what the reads count.
        return [streams[0].piece([{"read": [*s.state_dict()["read"][:2],
                                            s.state_dict()["read"][2] - len(pending)]}
                                  for s, pending in zip(streams, self.pending[rank])],
                                 self.workers)
                for rank, streams in enumerate(self.streams)]


# (ranks, workers, micro-batch, accumulation): a global batch of 8 samples on each.
LAYOUTS = [(1, 1, 8, 1), (1, 1, 4, 2), (2, 2, 4, 1), (2, 2, 2, 2), (4, 1, 2, 1), (4, 2, 1, 2),
           (1, 3, 8, 1)]


@pytest.mark.parametrize("name", STREAMS)
def test_every_layout_reads_the_same_global_batches_in_the_same_order(
        name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    orders = {}
    for ranks, workers, batch, accumulation in LAYOUTS:
        layout = Layout(STREAMS[name], ranks, workers, batch, Progress(), monkeypatch)
        orders[ranks, workers, batch] = layout.global_batches(12, accumulation)
    one_process = orders[1, 1, 8]
    for layout_key, batches in orders.items():
        # Not only each global batch's samples: their order over the micro-steps too.
        assert batches == one_process, layout_key
    stream = STREAMS[name]()
    assert [key(stream.sample(p)) for p in range(96)] == [k for b in one_process for k in b]


def test_packed_samples_cut_the_documents_tokens_in_pass_order() -> None:
    docs = documents()
    flat = [token for doc in docs for token in doc]
    stream = packed(shuffle=False)
    count = 3 * len(flat) // SEQUENCE  # three passes: each continues where the last ended
    read = [t for p in range(count) for t in stream.sample(p).tolist()]
    assert read == (flat * 3)[:count * SEQUENCE]
    # Shuffled: the first pass is the documents in that pass's order, each whole, once.
    shuffled = packed()
    first = [t for p in range(len(flat) // SEQUENCE) for t in shuffled.sample(p).tolist()]
    assert Counter(first) <= Counter(flat) and len(first) > len(flat) - SEQUENCE
    assert first != flat[:len(first)]


@pytest.mark.parametrize("name", STREAMS)
def test_a_resume_on_the_same_layout_continues_exactly(
        name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    whole = Layout(STREAMS[name], 2, 2, 2, Progress(), monkeypatch).global_batches(10)
    before = Layout(STREAMS[name], 2, 2, 2, Progress(), monkeypatch)
    assert before.global_batches(3) == whole[:3]  # an odd number of steps: worker 1 next
    after = Layout(STREAMS[name], 2, 2, 2, merge_progress(before.pieces()), monkeypatch)
    assert after.global_batches(7) == whole[3:]


@pytest.mark.parametrize("name", STREAMS)
def test_a_resume_on_other_layouts_continues_the_global_order(
        name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # 4 ranks x 2 workers with micro-batches of 3 (a global batch of 12), then 2 ranks x 1
    # worker of 6, then 3 ranks x 2 workers of 4: every step is the next 12 of one order.
    whole = Layout(STREAMS[name], 1, 1, 12, Progress(), monkeypatch).global_batches(12)
    read, progress = [], Progress()
    for (ranks, workers, batch), steps in zip([(4, 2, 3), (2, 1, 6), (3, 2, 4)], [5, 3, 4]):
        layout = Layout(STREAMS[name], ranks, workers, batch, progress, monkeypatch)
        read += layout.global_batches(steps)
        progress = merge_progress(layout.pieces())
    assert read == whole
    assert progress == Progress([(0, 144)])


def test_uneven_reads_leave_holes_that_the_next_run_fills_once(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # Ranks reading different amounts (not what the trainer does, which steps them together)
    # leave a position that is no prefix; the next runs read exactly what it lacks.
    draw, seen, progress = random.Random(0), Counter[Any](), Progress()
    for ranks in (4, 2, 3, 1, 5, 2):
        layout = Layout(packed, ranks, 1, 2, progress, monkeypatch)
        for rank in range(ranks):
            for _ in range(draw.randint(1, 6)):
                seen.update(key(s) for s in layout.micro_batch(rank))
        progress = merge_progress(layout.pieces())
    stream = packed()
    said = Counter(key(stream.sample(p)) for a, b in progress.consumed for p in range(a, b))
    assert seen == said and len(progress.consumed) > 1


def test_worker_positions_come_from_the_stateful_loader_and_resume_on_other_workers() -> None:
    from torchdata.stateful_dataloader import StatefulDataLoader

    stream = packed()
    stream.distribute(1, 0, 2)
    loader = StatefulDataLoader(stream, batch_size=2, num_workers=2)
    batches = iter(loader)
    first = [next(batches) for _ in range(5)]
    piece = loader_piece(loader, stream)
    assert piece["slots"] == 2 and piece["reads"] == [[0, 6], [1, 4]]
    again = packed()
    again.distribute(1, 0, 5)
    again.resume(merge_progress([piece]))
    rest = [next(iter(DataLoader(again, batch_size=5))) for _ in range(1)]
    expected = [packed().sample(p) for p in range(15)]
    assert torch.equal(torch.cat(first + rest), torch.stack(expected))


def test_the_length_index_comes_from_a_column_a_list_arrow_or_a_cache(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import datasets

    docs = documents()
    counts = [len(doc) for doc in docs]
    table = datasets.Dataset.from_dict({"input_ids": docs, "n": counts})
    reference = [packed(False).sample(p).tolist() for p in range(30)]
    for stream in (ShardedStream(table, shuffle=False, sequence_length=SEQUENCE),
                   ShardedStream(table, shuffle=False, sequence_length=SEQUENCE, lengths="n"),
                   ShardedStream(docs, shuffle=False, sequence_length=SEQUENCE,
                                 lengths=counts)):
        assert stream.lengths is not None and stream.lengths.tolist() == counts
        assert [stream.sample(p).tolist() for p in range(30)] == reference
    # Read from the cache the second time; a cache of another source is found again.
    cache, reads = tmp_path / "lengths.bin", Counter[int]()

    class Counted(list):  # type: ignore[type-arg]
        def __getitem__(self, index: Any) -> Any:
            reads[index] += 1
            return super().__getitem__(index)

    ShardedStream(Counted(docs), sequence_length=SEQUENCE, index_cache=cache)
    assert sum(reads.values()) == len(docs) and cache.exists()
    again = ShardedStream(Counted(docs), sequence_length=SEQUENCE, index_cache=cache)
    assert sum(reads.values()) == len(docs) and again.lengths is not None
    assert again.lengths.tolist() == counts
    other = ShardedStream(docs[:10], sequence_length=SEQUENCE, index_cache=cache)
    assert other.lengths is not None and other.lengths.tolist() == counts[:10]


def test_bad_inputs_are_refused_by_name() -> None:
    with pytest.raises(ValueError, match="non-empty"):
        ShardedStream([])
    with pytest.raises(ValueError, match="sequence_length=0"):
        ShardedStream([1], sequence_length=0)
    with pytest.raises(ValueError, match="give sequence_length too"):
        ShardedStream([[1]], lengths=[1])
    with pytest.raises(ValueError, match="no tokens to pack"):
        ShardedStream([[], []], sequence_length=2)
    with pytest.raises(ValueError, match="3 entries for a source of 2 items"):
        ShardedStream([[1], [2]], sequence_length=2, lengths=[1, 1, 1])
    stale = ShardedStream([[1, 2], [3]], sequence_length=2, lengths=[1, 2], shuffle=False)
    with pytest.raises(ValueError, match="item 0 has 2 tokens but the length index says 1"):
        stale.sample(0)
    stream = ShardedStream(list(range(5)))
    with pytest.raises(ValueError, match="rank 2 is not in"):
        stream.distribute(2, 2)
    with pytest.raises(ValueError, match="merge_progress"):
        stream.load_state_dict({"read": [0, 1, 3]})
    with pytest.raises(ValueError, match="num_workers=2"):
        check_stream_loader(DataLoader(stream, batch_size=2, num_workers=2))
    with pytest.raises(ValueError, match="without a batch_size"):
        check_stream_loader(DataLoader(stream, batch_size=None))
    piece: dict[str, Any] = stream.piece([None], 0)
    with pytest.raises(ValueError, match=r"lack slots \[1\] of 2"):
        merge_progress([{**piece, "slots": 2}])
    with pytest.raises(ValueError, match="different runs"):
        merge_progress([piece, {**piece, "progress": Progress([(0, 3)]).as_dict(),
                                "reads": [[1, 0]]}])
    old = {"progress": {"consumed": [], "partial": []}, "slots": 1, "reads": [[0, 4, 2]]}
    with pytest.raises(ValueError, match="before streams had one global sample order"):
        merge_progress([old])


def test_in_order_false_is_refused() -> None:
    from torchdata.stateful_dataloader import StatefulDataLoader

    loader = StatefulDataLoader(ShardedStream(list(range(5))), batch_size=2, num_workers=2,
                                in_order=False)
    with pytest.raises(ValueError, match="in_order=False"):
        check_stream_loader(loader)


def test_the_progress_survives_a_round_trip_through_plain_types() -> None:
    progress = Progress([(0, 5), (7, 9)])
    state = progress.as_dict()
    assert state == {"consumed": [[0, 5], [7, 9]]}
    assert Progress.from_dict(state) == progress
    # The unread positions are 5, 6, 9, 10, ...: work-list entries 0-3 are those four.
    assert progress.unread(0, 4) == [(5, 7), (9, 11)]
