"""Checking that a checkpoint's declared tensor sizes are backed by the bytes it stores.

A DCP ``.metadata`` declares each tensor's size and its chunks, and a reader allocates that
size before it reads a byte (export's and resume's targets are ``torch.empty(size)``). A
declared size nothing stores (a 63 KB checkpoint declaring a 256 MiB tensor whose one chunk
is a zero-stride view) would make the reader allocate and write what was never saved. This
check, run once per metadata read by ``directory.verify_files``, ties every allocation to
stored bytes: a tensor's chunks lie inside it, do not overlap and cover it, and each chunk's
stored entry holds at least its elements' bytes; ``verify_files`` then checks that the files
hold those entries. Everything allocated from the metadata is then at most the checkpoint's
own size.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from dream_trainer.errors import CheckpointError
from dream_trainer.utils.boxes import tiling_problem
from dream_trainer.utils.text import printable

if TYPE_CHECKING:  # DCP takes about a second to import, which import dream_trainer should not
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

_SHOWN = 4  # chunks an error lists


def check_declared_sizes(source: Any, metadata: Any) -> None:
    """Refuse metadata (read from ``source``) that declares a tensor its chunks do not cover
    exactly once, or a chunk whose stored entry holds fewer bytes than its elements.

    Raises:
        CheckpointError: naming ``source``, the tensor, and what is wrong.
    """
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    for fqn, entry in metadata.state_dict_metadata.items():
        if isinstance(entry, TensorStorageMetadata):
            problem = _problem(fqn, entry, metadata.storage_data)
            if problem is not None:
                raise CheckpointError(
                    f"{source} declares the tensor {fqn!r} {printable(list(entry.size))}, "
                    f"but {problem}: reading it would "
                    "allocate memory no stored bytes fill. The checkpoint was altered or "
                    "crafted; do not use it")


def _problem(fqn: str, entry: TensorStorageMetadata, storage_data: Any) -> str | None:
    """What keeps ``entry``'s declared size from being backed by stored bytes, or None."""
    from torch.distributed.checkpoint.metadata import MetadataIndex

    size = tuple(entry.size)
    if not all(type(n) is int and n >= 0 for n in size):
        return "its size is not a list of element counts"
    boxes = [(chunk.offsets, chunk.sizes) for chunk in entry.chunks]
    if not all(type(n) is int for offsets, sizes in boxes for n in (*offsets, *sizes)):
        return "its chunks' offsets and sizes are not integers"
    problem = tiling_problem(size, boxes)
    if problem is not None:
        shown = [(list(offsets), list(sizes)) for offsets, sizes in boxes[:_SHOWN]]
        more = f" and {len(boxes) - _SHOWN} more" if len(boxes) > _SHOWN else ""
        return f"its {len(boxes)} chunks {problem} (offsets and sizes: {shown}{more})"
    itemsize = entry.properties.dtype.itemsize
    for offsets, sizes in boxes:
        needed = math.prod(sizes) * itemsize
        if needed == 0:
            continue
        info = storage_data.get(MetadataIndex(fqn, offsets))
        if info is None:
            return f"its chunk at {list(offsets)} is stored nowhere"
        if getattr(info, "transform_descriptors", None):
            # A transformed (compressed) entry's length says nothing of what it unpacks to;
            # dream_trainer writes none.
            return (f"its chunk at {list(offsets)} is stored transformed "
                    f"({printable(info.transform_descriptors)}), which dream_trainer never "
                    "writes")
        if type(info.length) is not int or info.length < needed:
            return (f"its chunk at {list(offsets)} of {list(sizes)} elements needs "
                    f"{needed} bytes and its stored entry holds {printable(info.length)}")
    return None
