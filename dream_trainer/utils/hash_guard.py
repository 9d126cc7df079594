"""Building dicts and sets from untrusted keys without letting the keys choose the cost.

A dict or set inserts in constant time only while its keys' hashes differ. Integers, floats
and tuples of them hash the same in every process (strings and bytes are salted per
process), so a file can hold thousands of distinct keys with one hash and make each insert
compare against all the earlier ones: a megabyte of such keys keeps a reader busy for
minutes. Decoders of untrusted data (a checkpoint's pickles, a peer's state) count the keys
per hash first and refuse a container where too many collide.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sized
from typing import Any

MAX_SHARED_HASH = 64
"""Most keys of one container that may share a hash. Distinct integers of 64 bits share one
by at most 8 (Python reduces them modulo 2**61 - 1); no real state comes near 64."""


class HashFloodError(ValueError):
    """Too many keys of one container share a hash (a crafted input)."""


def count_keys(keys: Iterable[Any], counts: Counter[int], what: str) -> None:
    """Add ``keys`` to ``counts``, one container's tally of keys per hash so far.

    Linear in the number of keys: the counter is keyed by the hashes themselves, integers
    that Python hashes to themselves.

    Raises:
        HashFloodError: naming ``what``, once more than ``MAX_SHARED_HASH`` share a hash.
        TypeError: for an unhashable key.
    """
    for key in keys:
        code = hash(key)
        counts[code] += 1
        if counts[code] > MAX_SHARED_HASH:
            raise HashFloodError(
                f"{what} holds more than {MAX_SHARED_HASH} distinct keys with the same hash; "
                "no real state has that many: the data was crafted to make reading it take "
                "hours, so it is refused")


def check_key_spread(keys: Iterable[Any], what: str) -> None:
    """Refuse ``keys``, those of one dict or set, if too many share a hash (``count_keys``).

    Raises:
        HashFloodError: naming ``what``.
    """
    if isinstance(keys, Sized) and len(keys) <= MAX_SHARED_HASH:
        return
    count_keys(keys, Counter(), what)


def guarded_dict(pairs: list[tuple[Any, Any]], what: str) -> dict[Any, Any]:
    """``dict(pairs)`` once ``check_key_spread`` has passed its keys.

    Raises:
        HashFloodError: naming ``what``.
    """
    check_key_spread([key for key, _ in pairs], what)
    return dict(pairs)
