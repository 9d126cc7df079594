"""The token count of every item of a source: what packing from one global order needs.

A packed stream's sample ``k`` is tokens ``[k L, (k + 1) L)`` of the items' tokens
concatenated in the pass's order, so finding it needs the items' lengths, all of them, before
the first sample: they come from a column that holds them, from the token column of a
``datasets.Dataset`` (read by Arrow, without decoding a row), or from reading every item once;
a cache file keeps them for the next run.
"""

from __future__ import annotations

import array
import hashlib
import json
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from dream_trainer.utils.files import write_atomically

_MAGIC = b"dream_trainer lengths 1\n"


def length_index(source: Any, tokens: Callable[[Any], Sequence[int]] | None,
                 lengths: Sequence[int] | str | None,
                 cache: str | os.PathLike[str] | None) -> torch.Tensor:
    """Every item's token count, as an int64 tensor of ``len(source)`` entries.

    Args:
        source: The stream's source.
        tokens: The stream's token function (None: ``item["input_ids"]`` or the item).
        lengths: The counts themselves, or the name of a column of ``source`` holding them,
            or None to find them (Arrow's list lengths for a ``datasets.Dataset`` with an
            ``input_ids`` column and the default token function; else every item read once).
        cache: A file for the counts found: read when it matches the source, else written.

    Raises:
        ValueError: for counts of another number of items than the source has, or a
            negative count.
    """
    size = len(source)
    key = _source_key(source)
    if cache is not None and lengths is None:
        cached = _read_cache(Path(cache), size, key)
        if cached is not None:
            return cached
    if isinstance(lengths, str):
        found = _arrow_column(source, lengths, counts=False)
        if found is None:
            found = torch.as_tensor(list(source[lengths]), dtype=torch.int64)
    elif lengths is not None:
        found = torch.as_tensor(list(lengths), dtype=torch.int64)
    else:
        found = _arrow_column(source, "input_ids", counts=True) if tokens is None else None
        if found is None:
            read = tokens or default_tokens
            found = torch.tensor([len(read(source[index])) for index in range(size)],
                                 dtype=torch.int64)
    if found.shape != (size,):
        raise ValueError(f"the length index has {found.numel()} entries for a source of "
                         f"{size} items: give one token count per item")
    if bool((found < 0).any()):
        raise ValueError(f"the length index counts {int(found.min())} tokens for item "
                         f"{int(found.argmin())}: token counts cannot be negative")
    if cache is not None and lengths is None:
        _write_cache(Path(cache), found, key)
    return found


def default_tokens(item: Any) -> Sequence[int]:
    """An item's token ids: ``item["input_ids"]`` for a mapping, else the item itself."""
    if isinstance(item, Mapping):
        return item["input_ids"]
    if isinstance(item, torch.Tensor):
        return item.tolist()
    return item


def _arrow_column(source: Any, name: str, counts: bool) -> torch.Tensor | None:
    """Column ``name`` of a ``datasets.Dataset`` read by Arrow, as it is or (``counts``) the
    lengths of its lists; None for other sources."""
    table = getattr(source, "data", None)
    if getattr(source, "_indices", True) is not None or name not in getattr(
            source, "column_names", ()) or not hasattr(table, "column"):
        return None  # not a Dataset, or one whose rows are a selection of its table's
    column = table.column(name)
    if counts:
        import pyarrow.compute as pc

        column = pc.list_value_length(column).fill_null(0)
    return torch.from_numpy(column.to_numpy().astype("int64"))


def _source_key(source: Any) -> str:
    """What a cache is checked against: the item count, and a ``datasets`` fingerprint."""
    fingerprint = getattr(source, "_fingerprint", None)
    return json.dumps({"items": len(source), "fingerprint": fingerprint})


def _read_cache(path: Path, size: int, key: str) -> torch.Tensor | None:
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None
    header, _, body = data[len(_MAGIC):].partition(b"\n")
    digest, _, saved_key = header.decode("utf-8", "replace").partition(" ")
    if not data.startswith(_MAGIC) or saved_key != key \
            or hashlib.sha256(body).hexdigest() != digest or len(body) != 8 * size:
        return None  # another source's, or damaged: found again and rewritten
    return torch.frombuffer(bytearray(body), dtype=torch.int64)


def _write_cache(path: Path, counts: torch.Tensor, key: str) -> None:
    body = array.array("q", counts.tolist()).tobytes()
    header = f"{hashlib.sha256(body).hexdigest()} {key}\n".encode()
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomically(path, _MAGIC + header + body)
