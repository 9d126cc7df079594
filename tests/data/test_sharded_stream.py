"""ShardedStream in one process: the merged position after reads on any number of slots,
re-dealt to another number, reads every remaining item (and token) exactly once."""

from __future__ import annotations

import copy
import random
from collections import Counter
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader

from dream_trainer.data import ShardedStream
from dream_trainer.data.sharded import (Progress, check_stream_loader, loader_piece,
                                        merge_progress)
from tests.helpers.sharded import documents


def read_on(progress: Progress, ranks: int, counts: list[int],
            sequence_length: int | None) -> tuple[Progress, list[int]]:
    """Each of ``ranks`` ranks (no workers) reads ``counts[rank]`` samples after
    ``progress``: the merged progress and every token read."""
    pieces, tokens = [], []
    for rank in range(ranks):
        stream = ShardedStream(documents(), seed=3, sequence_length=sequence_length)
        stream.distribute(ranks, rank)
        stream.resume(copy.deepcopy(progress))
        samples = iter(stream)
        for _ in range(counts[rank]):
            sample = next(samples)
            tokens += sample.tolist() if sequence_length else sample
        pieces.append(stream.piece([stream.state_dict()], 0))
    return merge_progress(pieces), tokens


def tokens_of(progress: Progress) -> list[int]:
    """The tokens ``progress`` says were read: whole items, and the first tokens of others."""
    stream = ShardedStream(documents(), seed=3)
    tokens = [t for start, stop in progress.consumed for position in range(start, stop)
              for t in stream.item(position)]
    return tokens + [t for position, read in progress.partial.items()
                     for t in stream.item(position)[:read]]


@pytest.mark.parametrize("sequence_length", [None, 4, 7])
def test_reads_over_changing_rank_counts_are_exactly_what_the_merged_position_says(
        sequence_length: int | None) -> None:
    draw = random.Random(sequence_length)
    progress, tokens = Progress(), []
    # Uneven counts per rank: a rank that read more leaves positions past the frontier.
    for ranks in (4, 2, 3, 1, 5, 2):
        progress, read = read_on(progress, ranks, [draw.randint(3, 15) for _ in range(ranks)],
                                 sequence_length)
        tokens += read
    assert Counter(tokens) == Counter(tokens_of(progress))
    if sequence_length:  # packing cut some documents: their rest is still owed
        assert progress.partial
    # Past the first pass of 48 documents: each was read whole, once in that pass.
    assert progress.consumed[0] == (0, progress.consumed[0][1])
    assert progress.consumed[0][1] >= 48


def test_a_pass_is_a_permutation_and_each_pass_is_shuffled_anew() -> None:
    stream = ShardedStream(list(range(10)), seed=1)
    first = [stream.item(p) for p in range(10)]
    second = [stream.item(p) for p in range(10, 20)]
    assert sorted(first) == sorted(second) == list(range(10))
    assert first != second and first != list(range(10))
    assert [ShardedStream(list(range(10)), shuffle=False).item(p) for p in range(12)] == \
        [*range(10), 0, 1]


def test_worker_positions_come_from_the_stateful_loader_and_resume_on_other_workers() -> None:
    from torchdata.stateful_dataloader import StatefulDataLoader

    stream = ShardedStream(documents(), seed=2, sequence_length=5)
    loader = StatefulDataLoader(stream, batch_size=2, num_workers=2)
    batches = iter(loader)
    # Three batches: worker 0 returned two, worker 1 one (in order, round-robin).
    read = [t for _ in range(3) for t in next(batches).flatten().tolist()]
    piece = loader_piece(loader, stream)
    assert piece["slots"] == 2 and [slot for slot, _, _ in piece["reads"]] == [0, 1]
    progress = merge_progress([piece])
    del batches
    again = ShardedStream(documents(), seed=2, sequence_length=5)
    again.resume(progress)
    loader = StatefulDataLoader(again, batch_size=2, num_workers=1)
    batches = iter(loader)
    read += [t for _ in range(4) for t in next(batches).flatten().tolist()]
    progress = merge_progress([loader_piece(loader, again)])
    del batches
    reference = ShardedStream(documents(), seed=2)
    expected = [t for start, stop in progress.consumed for p in range(start, stop)
                for t in reference.item(p)]
    expected += [t for p, n in progress.partial.items() for t in reference.item(p)[:n]]
    assert Counter(read) == Counter(expected)


def test_bad_inputs_are_refused_by_name() -> None:
    with pytest.raises(ValueError, match="non-empty source"):
        ShardedStream([])
    with pytest.raises(ValueError, match="sequence_length=0"):
        ShardedStream([[1]], sequence_length=0)
    stream = ShardedStream([[1, 2]])
    with pytest.raises(ValueError, match=r"rank 2 is not in \[0, 2\)"):
        stream.distribute(2, 2)
    with pytest.raises(ValueError, match="StatefulDataLoader"):
        check_stream_loader(DataLoader(stream, num_workers=2))
    check_stream_loader(DataLoader(stream, num_workers=0))
    with pytest.raises(ValueError, match="merge_progress"):
        stream.load_state_dict({"read": [0, 1, 1, 0]})
    piece: dict[str, Any] = stream.piece([None], 0)
    with pytest.raises(ValueError, match=r"lack slots \[1\] of 2"):
        merge_progress([{**piece, "slots": 2}])
    with pytest.raises(ValueError, match="different runs"):
        merge_progress([piece, {**piece, "progress": Progress([(0, 3)]).as_dict(),
                                "reads": [[1, 0, 0]]}])


def test_the_progress_survives_a_round_trip_through_plain_types() -> None:
    progress = Progress([(0, 5), (7, 9)], {5: 3})
    state = progress.as_dict()
    assert torch.equal(torch.tensor(state["consumed"]), torch.tensor([[0, 5], [7, 9]]))
    assert Progress.from_dict(state) == progress
    assert next(progress.work()) == (5, 3)  # the cut position comes first
    assert [p for p, _ in zip(progress.fresh(0), range(4))] == [6, 9, 10, 11]


def test_documents_cut_mid_way_continue_from_the_last_cut_whoever_reads_them() -> None:
    long_documents = [[100 * d + i for i in range(30)] for d in range(8)]

    def round_of(progress: Progress, counts: list[int]) -> tuple[Progress, list[int]]:
        pieces, tokens = [], []
        for rank, count in enumerate(counts):
            stream = ShardedStream(long_documents, shuffle=False, sequence_length=4)
            stream.distribute(len(counts), rank)
            stream.resume(copy.deepcopy(progress))
            samples = iter(stream)
            tokens += [t for _ in range(count) for t in next(samples).tolist()]
            pieces.append(stream.piece([stream.state_dict()], 0))
        return merge_progress(pieces), tokens

    # Two ranks cut documents 0 and 1 after 4 tokens.
    progress, tokens = round_of(Progress(), [1, 1])
    assert progress == Progress([], {0: 4, 1: 4})
    # Three ranks: the first reads nothing, the second finishes document 1 (26 tokens) and
    # starts its next, the third cuts document 2: document 0 stays cut at 4, though the
    # second rank read past it.
    progress, read = round_of(progress, [0, 7, 3])
    tokens += read
    assert progress.partial[0] == 4 and 1 not in progress.partial
    assert progress.partial[2] == 12
    # Another three: the first now reads 4 more tokens of document 0.
    progress, read = round_of(progress, [1, 0, 0])
    tokens += read
    assert progress.partial[0] == 8
    progress, read = round_of(progress, [60])
    tokens += read
    expected = [t for start, stop in progress.consumed for p in range(start, stop)
                for t in long_documents[p % 8]]
    expected += [t for p, n in progress.partial.items() for t in long_documents[p % 8][:n]]
    assert Counter(tokens) == Counter(expected)
    assert progress.consumed[0][1] >= 8
