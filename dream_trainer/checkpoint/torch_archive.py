"""Reading a ``torch.save`` archive (a zip of one pickle and the tensors' storages) through
the safe decoder: DCP stores every tensor and non-tensor item of a checkpoint this way.

What the zip declares is checked against the archive's bytes before anything is allocated:
torch.save stores its members uncompressed and side by side, so together they hold at most
the archive's length. Each storage is read once, however many tensors name it (as
``torch.load`` does), and the views the tensors take of them are bounded in bytes
(``VIEW_MULTIPLE``), so an archive costs what its bytes cost.
"""

from __future__ import annotations

import copy
import io
import zipfile
from collections.abc import Callable, Mapping
from typing import IO, Any

import torch

from dream_trainer.checkpoint.allowlist import Refusal, Storage, ViewBytes
from dream_trainer.checkpoint.safe_pickle import MAX_PICKLE_BYTES, loads
from dream_trainer.errors import CheckpointError

VIEW_MULTIPLE = 16
"""Bytes of tensor views an archive may yield per byte of it. An honest archive holds each
tensor once (views at most its bytes), or a few views of one storage (a matrix and its
transpose, rows of it); a view stretched with stride 0, or one storage named by hundreds of
full views, is refused."""
VIEW_BASE = 1 << 20
"""Bytes of views any archive may yield besides ``VIEW_MULTIPLE`` per byte (1 MiB): a small
expanded tensor (a broadcast scalar) saved as it is."""
_LOCAL_HEADER = 30
"""Bytes of a zip member's local header before its name: the least that precedes its data."""


def load_archive(data: bytes | IO[bytes], source: str,
                 trusted: Mapping[str, Any] | None = None,
                 map_location: torch.device | str | None = None) -> Any:
    """Decode a ``torch.save`` archive (zip) of plain values and tensors.

    Args:
        data: The archive's bytes, or a seekable file of them (read in place: a tensor's
            bytes are copied once, into its storage).

    Raises:
        CheckpointError: naming ``source`` and what was refused.
    """
    file = io.BytesIO(data) if isinstance(data, bytes) else data
    size = file.seek(0, io.SEEK_END)
    reader = _Members(size)
    refused: CheckpointError | None = None  # raised after the handler (see safe_pickle.loads)
    try:
        archive = zipfile.ZipFile(file)
        pickles = [name for name in archive.namelist() if name.endswith("/data.pkl")]
        if len(pickles) != 1:
            raise CheckpointError(f"{source} is not a torch.save archive (no single data.pkl)")
        prefix = pickles[0].removesuffix("data.pkl")
        member = archive.getinfo(pickles[0])
        if member.file_size > MAX_PICKLE_BYTES:
            raise Refusal(f"a pickle of {member.file_size} bytes, more than the "
                          f"{MAX_PICKLE_BYTES} a checkpoint's pickle may have")
        pickled = bytes(reader.read(archive, member))
    except zipfile.BadZipFile as exc:
        refused = CheckpointError(f"{source} is not a torch.save archive: {exc}")
    except Refusal as exc:
        refused = CheckpointError(f"{source} cannot be read safely: it holds {exc}; it was "
                                  "not written by dream_trainer or torch, or was altered")
    if refused is not None:
        raise refused

    views = ViewBytes(VIEW_MULTIPLE * size + VIEW_BASE, size)
    read: dict[str, torch.UntypedStorage] = {}

    def storage(key: str, dtype: torch.dtype, count: int) -> Storage:
        try:
            member = archive.getinfo(f"{prefix}data/{key}")
        except KeyError:
            raise Refusal(f"a storage {key[:40]!r} the archive does not hold") from None
        if member.file_size != count * dtype.itemsize:
            raise Refusal(f"a storage of {member.file_size} bytes declared as {count} x "
                          f"{dtype}")
        if key not in read:
            read[key] = torch.frombuffer(reader.read(archive, member), dtype=torch.uint8) \
                .untyped_storage() if member.file_size else torch.UntypedStorage(0)
        return Storage(read[key], dtype, views)

    value = loads(pickled, source, "item", trusted, storage)
    return value if map_location is None else _to(value, torch.device(map_location))


class _Members:
    """Reads an archive's members, refusing before it allocates one that its record says is
    compressed, larger than the archive, or past its end, or members that together claim
    more bytes than the archive holds."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.left = size

    def read(self, archive: zipfile.ZipFile, member: zipfile.ZipInfo) -> bytearray:
        name = member.filename[-60:]
        if member.compress_type != zipfile.ZIP_STORED:
            raise Refusal(f"a compressed member {name!r} (torch.save stores its members "
                          "uncompressed; a compressed one can claim any size)")
        claimed = member.file_size
        if member.compress_size != claimed or claimed > self.left \
                or member.header_offset + _LOCAL_HEADER + claimed > self.size:
            raise Refusal(f"a member {name!r} of {claimed} bytes where the archive of "
                          f"{self.size} bytes has at most {min(self.left, self.size)} left")
        self.left -= claimed
        # Read straight into the memory the tensor keeps: one copy, as torch.load makes.
        raw = bytearray(claimed)
        with archive.open(member) as file:
            if file.readinto(raw) != claimed:
                raise Refusal(f"a member {name!r} shorter than its record")
        return raw


def _to(value: Any, device: torch.device) -> Any:
    """``value`` with its tensors moved to ``device`` (containers rebuilt)."""
    return rebuild(value, lambda leaf: leaf.to(device) if isinstance(leaf, torch.Tensor)
                   else leaf)


def rebuild(root: Any, leaf: Callable[[Any], Any]) -> Any:
    """``root`` with every value other than a dict, list or tuple replaced by ``leaf(value)``
    and those containers rebuilt around them (keeping their types), without recursion: a
    decoded value may nest ``MAX_DEPTH`` deep below a deep caller."""
    opened = _items(root)
    if opened is None:
        return leaf(root)
    # Each frame: a container, its items, and what its items became so far.
    stack: list[tuple[Any, list[Any], list[Any]]] = [(root, opened, [])]
    while True:
        value, items, done = stack[-1]
        if len(done) < len(items):
            item = items[len(done)]
            inner = _items(item)
            if inner is None:
                done.append(leaf(item))
            else:
                stack.append((item, inner, []))
            continue
        stack.pop()
        made = _assemble(value, done)
        if not stack:
            return made
        stack[-1][2].append(made)


def _items(value: Any) -> list[Any] | None:
    if isinstance(value, dict):
        return list(value.values())
    if isinstance(value, (list, tuple)):
        return list(value)
    return None


def _assemble(value: Any, items: list[Any]) -> Any:
    if isinstance(value, dict):
        made = copy.copy(value)  # keeps the subclass (OrderedDict, defaultdict)
        for key, item in zip(list(value), items):
            made[key] = item
        return made
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # a trusted namedtuple
        return type(value)(*items)
    return type(value)(items)
