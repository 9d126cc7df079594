"""Packed samples that keep their documents apart: what ``ShardedStream(documents=True)``
yields.

A packed sample of ``L`` tokens holds pieces of consecutive items (documents). Besides the
tokens it carries, per token, the token's position inside its document (restarting at 0,
continuing where a split document's earlier piece ended), which piece of the sample it
belongs to (``document_ids``, numbered 0, 1, ... in the sample), and its target: the label of
the next token of the same document, or -100 where the document ends (no target crosses a
boundary). An item's labels are its tokens unless the stream is given a ``labels`` function
(supervised fine-tuning: -100 on the tokens not trained).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch

IGNORE = -100
"""The target of a token that is not trained (``F.cross_entropy``'s default ``ignore_index``)."""

LongDocuments = Literal["split", "truncate"]
"""What packing does with a document longer than the sequence: ``"split"`` it over several
samples (positions continue; each piece attends only to itself), or ``"truncate"`` it to
the sequence length (its tokens past it are never read)."""


@dataclass
class Piece:
    """A run of one document's tokens inside a sample.

    Attributes:
        tokens: The document's tokens (after truncation), whole.
        labels: Its labels, aligned with ``tokens`` (unshifted; -100 where not trained).
        start: The first of its tokens this piece holds.
        stop: One past the last.
    """

    tokens: Sequence[int]
    labels: Sequence[int]
    start: int
    stop: int


def assemble(pieces: Sequence[Piece]) -> dict[str, torch.Tensor]:
    """The sample holding ``pieces`` in order: ``input_ids``, ``position_ids``,
    ``document_ids`` and ``targets``, each a ``LongTensor`` of the pieces' total length."""
    ids: list[int] = []
    positions: list[int] = []
    documents: list[int] = []
    targets: list[int] = []
    for number, piece in enumerate(pieces):
        ids.extend(piece.tokens[piece.start:piece.stop])
        positions.extend(range(piece.start, piece.stop))
        documents.extend([number] * (piece.stop - piece.start))
        # The target of token j is the label of token j + 1 of the same document: the next
        # sample holds it when the piece ends before the document does.
        targets.extend(piece.labels[piece.start + 1:piece.stop + 1])
        if piece.stop == len(piece.tokens):
            targets.append(IGNORE)
    return {"input_ids": torch.tensor(ids, dtype=torch.long),
            "position_ids": torch.tensor(positions, dtype=torch.long),
            "document_ids": torch.tensor(documents, dtype=torch.long),
            "targets": torch.tensor(targets, dtype=torch.long)}


def checked_labels(item: int, tokens: Sequence[int], labels: Sequence[int]) -> list[int]:
    """``labels`` as a list, once it is known to label every token of item ``item``.

    Raises:
        ValueError: naming the item, if the lengths differ.
    """
    labels = list(labels)
    if len(labels) != len(tokens):
        raise ValueError(f"item {item} has {len(tokens)} tokens but {len(labels)} labels: the "
                         "labels function must give one label per token (-100 where the "
                         "token is not trained)")
    return labels
