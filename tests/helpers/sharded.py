"""Documents with distinct tokens for the ShardedStream tests: every token names its document
and place, so a multiset of tokens read shows any token read twice or never."""

from __future__ import annotations

import random

DOCUMENTS, BATCH, SEQUENCE, VOCAB = 48, 2, 8, 97


def documents(count: int = DOCUMENTS) -> list[list[int]]:
    """``count`` documents of 1 to 12 tokens; token ``100 * d + i`` is document d's i-th."""
    lengths = random.Random(11)
    return [[100 * d + i for i in range(lengths.randint(1, 12))] for d in range(count)]
