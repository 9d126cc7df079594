"""Reading a checkpoint without running its code, whoever wrote it.

torch's DCP unpickles a checkpoint's ``.metadata`` with ``pickle.load`` and its items with
``torch.load``; a crafted file runs code through the one and can redirect the process through
the other. Here every pickle of a checkpoint (``.metadata``, each tensor, each non-tensor
item, each value dream_trainer packed into one) is decoded by ``safe_pickle``, which builds
fresh values of allowed types and refuses anything else with ``CheckpointError`` naming the
file. ``.metadata`` is checked against the checksum recorded at commit before it is parsed,
and files are opened without following symlinks. A user who keeps their own class in a
checkpoint trusts it explicitly: ``CheckpointParameters.trusted_globals`` or
``trust_globals()``.
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import io
from collections.abc import Iterable
from typing import IO, Any

import torch

from dream_trainer.checkpoint.directory import INFO, METADATA, CheckpointInfo
from dream_trainer.checkpoint.safe_pickle import MAX_PICKLE_BYTES, loads
from dream_trainer.checkpoint.storage import location, storage_for
from dream_trainer.checkpoint.storage_base import Location
from dream_trainer.checkpoint.torch_archive import load_archive
from dream_trainer.errors import CheckpointError

_TRUSTED: dict[str, Any] = {}
"""What ``trust_globals`` allowed, by full name."""


def trust_globals(*objects: type | Any) -> None:
    """Allow ``objects`` (classes or functions) in every checkpoint this process reads.

    For a type you keep in checkpointed state (``extra_state_dict``, a callback's
    ``state_dict``) and trust: checkpoints are otherwise unpickled through an allowlist.

    Raises:
        TypeError: if an object has no importable ``__module__``/``__qualname__``.
    """
    for obj in objects:
        module, name = getattr(obj, "__module__", None), getattr(obj, "__qualname__", None)
        if not (module and name) or "<locals>" in name:
            raise TypeError(f"trust_globals() takes importable classes or functions, got "
                            f"{obj!r}: define it at a module's top level")
        _TRUSTED[f"{module}.{name}"] = obj


def _resolve(name: str) -> Any:
    """The object a ``module.QualName`` names (the longest importable module prefix).

    Raises:
        CheckpointError: if it cannot be imported.
    """
    parts = name.split(".")
    for split in range(len(parts) - 1, 0, -1):
        try:
            obj: Any = importlib.import_module(".".join(parts[:split]))
        except ImportError:
            continue
        try:
            for attribute in parts[split:]:
                obj = getattr(obj, attribute)
        except AttributeError:
            break
        return obj
    raise CheckpointError(f"trusted_globals names {name}, which cannot be imported: check the "
                          "module path and the class name")


def _trusted(names: Iterable[str]) -> dict[str, Any]:
    """The user's trusted objects by full name: ``names`` resolved, and ``trust_globals``'."""
    return {**{name: _resolve(name) for name in sorted(frozenset(names))}, **_TRUSTED}


def load_item(data: io.BytesIO | bytes, source: str, trusted: Iterable[str] = (),
              map_location: torch.device | str | None = None) -> Any:
    """Decode a ``torch.save`` archive of plain values and tensors (a checkpoint item, or a
    value dream_trainer packed), its tensors moved to ``map_location``.

    Raises:
        CheckpointError: naming ``source`` and what it refused.
    """
    raw = data.getvalue() if isinstance(data, io.BytesIO) else data
    return load_archive(raw, source, _trusted(trusted), map_location)


def open_inside(directory: Location, name: str) -> IO[bytes]:
    """``directory / name`` opened for reading, refusing a symlink or anything but a regular
    file: a checkpoint's files are its own, and a link would read one no checksum covers.

    Raises:
        CheckpointError: naming the file.
    """
    return storage_for(directory).open_inside(directory, name)


def read_metadata_bytes(directory: Location) -> bytes:
    """The bytes of ``directory``'s ``.metadata``, checked against the checksum recorded in
    its ``dream_trainer.json`` (when it has one) before anyone parses them.

    Raises:
        CheckpointError: naming the file, if it is too large, a link, or altered.
    """
    storage = storage_for(directory)
    with open_inside(directory, METADATA) as file:
        size = storage.open_size(file)
        if size > MAX_PICKLE_BYTES:
            raise CheckpointError(f"{directory / METADATA} is {size} bytes, more than the "
                                  f"{MAX_PICKLE_BYTES} a checkpoint's metadata may have")
        data = file.read()
    # Absent while a save commits (the checksums are being computed) and in checkpoints
    # written before checksums: the decoder alone guards those.
    recorded = CheckpointInfo.read(directory).files if storage.is_file(directory / INFO) \
        else None
    if recorded is not None and METADATA in recorded \
            and hashlib.sha256(data).hexdigest() != recorded[METADATA]:
        raise CheckpointError(
            f"checkpoint file {directory / METADATA} does not match the checksum recorded when "
            "the checkpoint was written: its contents changed (a disk or copy error, or an "
            "edit); it was not parsed. Resume from an earlier checkpoint")
    return data


def safe_reader(path: str | Location, trusted: Iterable[str] = ()) -> Any:
    """A DCP storage reader for the checkpoint directory ``path`` (local, or a URL such as
    ``s3://bucket/prefix``) that decodes every pickle with ``safe_pickle`` and opens files
    without following symlinks (``reader_class()``)."""
    return reader_class()(location(path), _trusted(trusted))


@functools.cache
def reader_class() -> type:
    """The class of ``safe_reader``'s readers: a DCP ``FileSystemReader`` whose metadata and
    items go through ``safe_pickle``. Built on first use: importing DCP takes about a second,
    which ``import dream_trainer`` should not cost.

    DCP's public seams carry it where they exist: the ``StorageReader`` methods it overrides
    (``read_metadata``, ``read_data``) and the ``LoadPlanner`` calls that hand values over
    (``load_bytes``, ``resolve_tensor``, ``commit_tensor``). DCP has none for reading one item
    of a file, so that loop is written here over ``FileSystemReader``'s attributes
    ``storage_data`` (where each item lies, set by ``read_metadata``) and ``transforms`` (the
    stream transforms it was saved with); a torch that renames them fails the suite's
    checkpoint tests, not a run silently.
    """
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta
    from torch.distributed.checkpoint.planner import LoadItemType

    class SafeFileSystemReader(FileSystemReader):
        # Every read goes through the checkpoint's storage (storage_for), so one reader
        # serves local directories and object stores alike.
        def __init__(self, directory: Location, trusted: dict[str, Any]) -> None:
            super().__init__(str(directory))
            self.directory = directory
            self.storage = storage_for(directory)
            self.trusted = trusted
            # The metadata, decoded once per reader: it costs milliseconds per hundred
            # chunks, and a load asks for it twice (the shape check, then DCP).
            self.decoded: Any = None

        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            if self.decoded is None:
                self.decoded = loads(read_metadata_bytes(self.directory),
                                     str(self.directory / METADATA), "metadata")
            metadata = self.decoded
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

        def read_data(self, plan: Any, planner: Any) -> torch.futures.Future[None]:
            # DCP's own loop, with its torch.load calls replaced by the safe decoder.
            per_file: dict[str, list[Any]] = {}
            for item in plan.items:
                per_file.setdefault(self.storage_data[item.storage_index].relative_path,
                                    []).append(item)
            for name, items in per_file.items():
                with open_inside(self.directory, name) as file:
                    for item in items:
                        self.read_item(file, self.directory / name, item, planner)
            done: torch.futures.Future[None] = torch.futures.Future()
            done.set_result(None)
            return done

        def read_item(self, file: IO[bytes], path: Location, item: Any, planner: Any) -> None:
            info = self.storage_data[item.storage_index]
            if self.storage.open_size(file) < info.offset + info.length:
                raise CheckpointError(f"checkpoint file {path} is truncated: item "
                                      f"{item.storage_index.fqn} needs bytes up to "
                                      f"{info.offset + info.length}; resume from an earlier "
                                      "checkpoint")
            data = self.transforms.transform_load_stream(
                item, info.transform_descriptors or (), _Slice(file, info.offset, info.length))
            if not data.seekable():  # a transform's stream: zip reading needs to seek
                data = io.BytesIO(data.read())
            source = f"checkpoint {self.directory} (item {item.storage_index.fqn})"
            if item.type == LoadItemType.BYTE_IO:
                value = load_archive(data, source, self.trusted)
                # The planner torch.loads what it is given: hand it the decoded value saved
                # anew, which holds only allowed types.
                planner.load_bytes(item, io.BytesIO(_saved(value)))
                return
            tensor = load_archive(data, source)
            if not isinstance(tensor, torch.Tensor):
                raise CheckpointError(f"{source} should hold a tensor, not a "
                                      f"{type(tensor).__name__}")
            stored = tuple(tensor.size())
            offsets, lengths = tuple(item.storage_offsets), tuple(item.lengths)
            if len(stored) != len(lengths) or any(
                    start + length > size for start, length, size in zip(offsets, lengths,
                                                                         stored)):
                raise CheckpointError(f"{source} holds a tensor of size {stored}, which does not "
                                      f"hold the part the metadata reads from it (offsets "
                                      f"{offsets}, sizes {lengths}): the file or its metadata "
                                      "was altered; resume from an earlier checkpoint")
            for dim, (start, length) in enumerate(zip(offsets, lengths)):
                tensor = tensor.narrow(dim, start, length)
            target = planner.resolve_tensor(item).detach()
            if target.size() != tensor.size():
                raise CheckpointError(f"{source} holds a chunk of size {tuple(tensor.size())} "
                                      f"where the metadata places one of "
                                      f"{tuple(target.size())}")
            target.copy_(tensor)
            planner.commit_tensor(item, target)

    return SafeFileSystemReader


class _Slice(io.RawIOBase):
    """``length`` bytes of ``file`` from ``offset``, as a seekable file of their own: an item
    is decoded in place, without a copy of a whole tensor's bytes."""

    def __init__(self, file: IO[bytes], offset: int, length: int) -> None:
        super().__init__()
        self._file, self._start, self._length, self._position = file, offset, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._position, io.SEEK_END: self._length}[whence]
        self._position = min(max(base + offset, 0), self._length)
        return self._position

    def tell(self) -> int:
        return self._position

    def readinto(self, buffer: Any) -> int:
        count = min(len(buffer), self._length - self._position)
        if count <= 0:
            return 0
        self._file.seek(self._start + self._position)
        read = self._file.readinto(memoryview(buffer)[:count])  # type: ignore[attr-defined]
        self._position += read
        return read


def _saved(value: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()
