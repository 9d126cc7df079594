"""Reading a ``torch.save`` archive (a zip of one pickle and the tensors' storages) through
the safe decoder: DCP stores every tensor and non-tensor item of a checkpoint this way."""

from __future__ import annotations

import io
import zipfile
from collections import OrderedDict
from collections.abc import Mapping
from typing import IO, Any

import torch

from dream_trainer.checkpoint.allowlist import Refusal, Storage
from dream_trainer.checkpoint.safe_pickle import loads
from dream_trainer.errors import CheckpointError


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
    try:
        archive = zipfile.ZipFile(io.BytesIO(data) if isinstance(data, bytes) else data)
        pickles = [name for name in archive.namelist() if name.endswith("/data.pkl")]
        if len(pickles) != 1:
            raise CheckpointError(f"{source} is not a torch.save archive (no single data.pkl)")
        prefix = pickles[0].removesuffix("data.pkl")
        pickled = archive.read(pickles[0])
    except zipfile.BadZipFile as exc:
        raise CheckpointError(f"{source} is not a torch.save archive: {exc}") from None

    def storage(key: str, dtype: torch.dtype, count: int) -> Storage:
        try:
            member = archive.getinfo(f"{prefix}data/{key}")
        except KeyError:
            raise Refusal(f"a storage {key[:40]!r} the archive does not hold") from None
        if member.file_size != count * dtype.itemsize:
            raise Refusal(f"a storage of {member.file_size} bytes declared as {count} x "
                          f"{dtype}")
        if not member.file_size:
            return Storage(torch.UntypedStorage(0), dtype)
        # Read straight into the memory the tensor keeps: one copy, as torch.load makes.
        raw = bytearray(member.file_size)
        with archive.open(member) as file:
            if file.readinto(raw) != member.file_size:
                raise Refusal(f"a storage {key[:40]!r} shorter than its record")
        return Storage(torch.frombuffer(raw, dtype=torch.uint8).untyped_storage(), dtype)

    value = loads(pickled, source, "item", trusted, storage)
    return value if map_location is None else _to(value, torch.device(map_location))


def _to(value: Any, device: torch.device) -> Any:
    """``value`` with its tensors moved to ``device`` (containers rebuilt)."""
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, dict):
        moved = type(value)() if type(value) in (dict, OrderedDict) else value
        for key, item in list(value.items()):
            moved[key] = _to(item, device)
        return moved
    if type(value) in (list, tuple):
        return type(value)(_to(item, device) for item in value)
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # a trusted namedtuple
        return type(value)(*(_to(item, device) for item in value))
    return value
