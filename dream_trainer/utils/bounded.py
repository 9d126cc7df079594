"""Reading a small file from outside the code (a record, an index, a config) with its size
bounded before it is read, so that a huge or crafted file is refused instead of parsed."""

from __future__ import annotations

import os
from typing import IO

MAX_JSON_BYTES = 16 * 2**20
"""The largest ``config.json`` or ``dream_trainer.json`` a run reads whole: real ones are a
few kilobytes, and parsing 16 MiB of JSON takes under a second and a few hundred MiB."""
MAX_INDEX_BYTES = 64 * 2**20
"""The largest safetensors index read: an index lists every tensor of a model, and those of
the largest mixture-of-experts models (a hundred thousand tensors) are about 10 MB."""


def read_bounded(file: IO[bytes], name: object, limit: int = MAX_JSON_BYTES) -> bytes:
    """The contents of the open, seekable ``file`` (called ``name`` in the error), read from
    its start if it holds at most ``limit`` bytes.

    Raises:
        ValueError: naming the file, its size and the limit, if it holds more.
    """
    size = file.seek(0, os.SEEK_END)
    file.seek(0)
    data = file.read(limit + 1) if size <= limit else b""
    if size > limit or len(data) > limit:  # the second: it grew while being read
        raise ValueError(_too_large(name, max(size, len(data)), limit))
    return data


def _too_large(name: object, size: int, limit: int) -> str:
    """The message for a file of ``size`` bytes over the ``limit`` on what is read."""
    return (f"{name} holds {size} bytes, more than the {limit} bytes ({limit / 2**20:g} MiB) "
            "read of a file of its kind: real ones are far smaller, so it was altered or is "
            "not such a file")
