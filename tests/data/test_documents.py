"""``ShardedStream(documents=True)``: packed samples that carry each token's position in its
document, its document and a target that never crosses a boundary, in plain packing's global
order."""

from __future__ import annotations

import itertools

import pytest
import torch

from dream_trainer.data import ShardedStream
from dream_trainer.data.documents import IGNORE

# Documents of 3, 5, 2, 11 and 4 tokens; token t of document d is 100 d + t.
LENGTHS = (3, 5, 2, 11, 4)
SOURCE = [{"input_ids": [100 * d + t for t in range(n)]} for d, n in enumerate(LENGTHS)]


def first(stream: ShardedStream, count: int) -> list[dict[str, torch.Tensor]]:
    return [stream.sample(position) for position in range(count)]


def test_a_sample_carries_positions_documents_and_targets_inside_its_documents() -> None:
    stream = ShardedStream(SOURCE, shuffle=False, sequence_length=8, documents=True)
    sample = stream.sample(0)
    assert sample["input_ids"].tolist() == [0, 1, 2, 100, 101, 102, 103, 104]
    assert sample["position_ids"].tolist() == [0, 1, 2, 0, 1, 2, 3, 4]
    assert sample["document_ids"].tolist() == [0, 0, 0, 1, 1, 1, 1, 1]
    # The last token of each document has no target: the next one is another document's.
    assert sample["targets"].tolist() == [1, 2, IGNORE, 101, 102, 103, 104, IGNORE]
    # Document 3 (11 tokens) is split: its second piece continues its positions, and the
    # first piece's last token is trained on the first token of the next sample.
    second, third = stream.sample(1), stream.sample(2)
    assert second["input_ids"].tolist() == [200, 201, 300, 301, 302, 303, 304, 305]
    assert second["position_ids"].tolist() == [0, 1, 0, 1, 2, 3, 4, 5]
    assert second["targets"].tolist() == [201, IGNORE, 301, 302, 303, 304, 305, 306]
    assert third["input_ids"].tolist()[:5] == [306, 307, 308, 309, 310]
    assert third["position_ids"].tolist()[:5] == [6, 7, 8, 9, 10]
    assert third["document_ids"].tolist() == [0, 0, 0, 0, 0, 1, 1, 1]


def test_the_tokens_and_order_are_plain_packings_and_every_transition_is_trained_once() -> None:
    plain = ShardedStream(SOURCE, shuffle=True, seed=3, sequence_length=8)
    documents = ShardedStream(SOURCE, shuffle=True, seed=3, sequence_length=8, documents=True)
    samples = first(documents, 12)  # 96 tokens: three passes and a bit
    for position, sample in enumerate(samples):
        assert torch.equal(sample["input_ids"], plain.sample(position))
        ids, targets = sample["input_ids"].tolist(), sample["targets"].tolist()
        for token, target in zip(ids, targets, strict=True):
            # Within a document token t is followed by t + 1; nothing else is a target.
            assert target in (IGNORE, token + 1)
            if target != IGNORE:
                assert target // 100 == token // 100
    # Over whole passes every document's transitions are each a target exactly once.
    tokens = list(itertools.chain.from_iterable(s["input_ids"].tolist() for s in samples))
    targets = list(itertools.chain.from_iterable(s["targets"].tolist() for s in samples))
    per_pass = sum(LENGTHS)
    trained = [t for t in targets[:2 * per_pass] if t != IGNORE]
    assert len(trained) == 2 * sum(n - 1 for n in LENGTHS)
    assert sorted(trained) == sorted(2 * [100 * d + t for d, n in enumerate(LENGTHS)
                                          for t in range(1, n)])
    assert tokens[:per_pass] != tokens[per_pass:2 * per_pass]  # shuffled per pass


def test_truncated_documents_keep_their_first_tokens_only() -> None:
    stream = ShardedStream(SOURCE, shuffle=False, sequence_length=4, documents=True,
                           long_documents="truncate")
    assert stream.total_tokens == sum(min(n, 4) for n in LENGTHS)
    samples = first(stream, 5)
    ids = [token for sample in samples for token in sample["input_ids"].tolist()]
    assert ids[:sum(min(n, 4) for n in LENGTHS)] == [
        0, 1, 2, 100, 101, 102, 103, 200, 201, 300, 301, 302, 303, 400, 401, 402, 403]
    assert max(int(sample["position_ids"].max()) for sample in samples) == 3
    # A truncated document's last kept token has no target.
    assert samples[1]["input_ids"].tolist() == [101, 102, 103, 200]
    assert samples[1]["targets"].tolist() == [102, 103, IGNORE, 201]


def test_labels_mark_what_is_trained_and_are_shifted_like_the_tokens() -> None:
    def labels(item: dict[str, list[int]]) -> list[int]:
        # Train only the second half of each document, as SFT trains the answers.
        ids = item["input_ids"]
        return [IGNORE] * (len(ids) // 2) + ids[len(ids) // 2:]

    stream = ShardedStream(SOURCE, shuffle=False, sequence_length=8, documents=True,
                           labels=labels)
    sample = stream.sample(0)
    assert sample["targets"].tolist() == [1, 2, IGNORE, IGNORE, 102, 103, 104, IGNORE]

    broken = ShardedStream(SOURCE, shuffle=False, sequence_length=8, documents=True,
                           labels=lambda item: item["input_ids"][1:])
    with pytest.raises(ValueError) as error:
        broken.sample(0)
    assert str(error.value) == (
        "item 0 has 3 tokens but 2 labels: the labels function must give one label per "
        "token (-100 where the token is not trained)")


def test_every_rank_and_worker_reads_the_global_order_of_documents() -> None:
    whole = first(ShardedStream(SOURCE, shuffle=True, seed=1, sequence_length=8,
                                documents=True), 8)
    read: dict[int, dict[str, torch.Tensor]] = {}
    for rank in range(2):
        stream = ShardedStream(SOURCE, shuffle=True, seed=1, sequence_length=8, documents=True)
        stream.distribute(2, rank, batch_size=2)
        for block, sample in enumerate(itertools.islice(iter(stream), 4)):
            # Rank r reads blocks r, r + 2, ... of 2 samples each.
            position = ((block // 2) * 2 + rank) * 2 + block % 2
            read[position] = sample
    assert sorted(read) == list(range(8))
    for position, sample in read.items():
        for key in ("input_ids", "position_ids", "document_ids", "targets"):
            assert torch.equal(sample[key], whole[position][key]), (position, key)


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"documents": True}, "documents=True packs items as documents into sequences: give "
                          "sequence_length too"),
    ({"sequence_length": 8, "labels": len}, "labels and long_documents describe packed "
                                            "documents: give documents=True too, or leave "
                                            "them out"),
    ({"sequence_length": 8, "documents": True, "long_documents": "drop"},
     "long_documents='drop': give 'split' or 'truncate'"),
])
def test_document_options_are_checked(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError) as error:
        ShardedStream(SOURCE, **kwargs)  # type: ignore[arg-type]
    assert str(error.value) == message
