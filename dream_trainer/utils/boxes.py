"""Whether boxes of elements (a tensor's chunks) tile a tensor exactly, in linear time.

A tensor loaded from chunks is whole only if its chunks cover it exactly once: an element
no chunk holds keeps whatever its target held (uninitialized memory), and two chunks that
share one mean the file declares more than it stores. Comparing every pair of chunks costs
n^2 (an hour for a folder of a million one-element chunks); this check is exact and costs
one pass and a hash per corner (each box has 2^k corners along the k dimensions the chunks
split: 2 for a tensor split along its rows).

Why it is exact: let ``f(x)`` count the boxes holding element ``x``. Its d-fold difference
(the inverse of a d-dimensional running sum) is the sum over boxes of +-1 at each box's
2^d corners. If every corner point occurs an odd number of times exactly at the tensor's
own 2^d corners, that difference equals the tensor indicator's modulo 2, so ``f`` is odd
(at least 1) on every element of the tensor and even outside it. If the boxes also hold as
many elements together as the tensor, ``f`` is then exactly 1 on the tensor and 0 outside.
"""

from __future__ import annotations

import itertools
import math
from collections import Counter
from collections.abc import Iterator, Sequence

Box = tuple[Sequence[int], Sequence[int]]
"""A box of elements: its offsets, then its sizes, one per dimension."""

MAX_SPLIT_DIMS = 12
"""The most dimensions along which chunks may split a tensor (each box counts 2^k corners):
sharding splits one or two (FSDP's rows, tensor parallelism's columns)."""


def tiling_problem(size: Sequence[int], boxes: Sequence[Box]) -> str | None:
    """How ``boxes`` fail to cover the box ``[0, size)`` exactly once, or None when they do.

    Boxes that hold no element (a size of 0) are left out: they hold nothing to place.

    Returns:
        A phrase completing "the chunks ...": "differ in their number of dimensions",
        "reach outside it", "overlap", "hold 120 of its 128 elements", or "split it along
        more than 12 dimensions".
    """
    dims = len(size)
    if any(len(offsets) != dims or len(sizes) != dims for offsets, sizes in boxes):
        return "differ in their number of dimensions"
    held = [box for box in boxes if 0 not in box[1]]
    for offsets, sizes in held:
        for o, n, whole in zip(offsets, sizes, size):
            if o < 0 or n < 0 or o + n > whole:
                return "reach outside it"
    covered, total = sum(map(math.prod, (sizes for _, sizes in held))), math.prod(size)
    if covered > total:
        return "overlap"  # inside it, and more elements than it has
    if covered < total:
        return f"hold {covered} of its {total} elements"
    if total == 0:
        return None
    # Dimensions every box spans whole add nothing: count corners only along the others.
    split = [d for d in range(dims)
             if any(offsets[d] != 0 or sizes[d] != size[d] for offsets, sizes in held)]
    if len(split) > MAX_SPLIT_DIMS:
        return f"split it along more than {MAX_SPLIT_DIMS} dimensions"
    # A corner is one integer, its coordinates in mixed radix (Python's integers do not
    # overflow), so that counting them is one hash each.
    radix = [math.prod(size[d] + 1 for d in split[i + 1:]) for i in range(len(split))]
    counts = Counter(_corners(held, split, radix))
    odd = {corner for corner, count in counts.items() if count % 2}
    return None if odd == set(_corners([([0] * dims, size)], split, radix)) else "overlap"


def _corners(boxes: Sequence[Box], split: Sequence[int], radix: Sequence[int]
             ) -> Iterator[int]:
    """The 2^k corners (along the ``split`` dimensions) of each box, as integers."""
    if len(split) == 1:
        (d,) = split
        for offsets, sizes in boxes:
            yield offsets[d]
            yield offsets[d] + sizes[d]
        return
    for offsets, sizes in boxes:
        ends = [(offsets[d] * r, (offsets[d] + sizes[d]) * r) for d, r in zip(split, radix)]
        for corner in itertools.product(*ends):
            yield sum(corner)
