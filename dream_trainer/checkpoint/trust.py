"""Reading a checkpoint without running its code: every pickle in it goes through an allowlist.

torch's DCP unpickles a checkpoint's ``.metadata`` with ``pickle.load`` and its non-tensor
items with ``torch.load(weights_only=False)``; either runs whatever a crafted file asks for.
Here ``.metadata`` is unpickled by an unpickler that only constructs DCP's metadata classes
and torch's sizes, dtypes and layouts, and every non-tensor item (and every value
dream_trainer packed into one) by torch's weights-only unpickler, which constructs tensors,
builtin containers and scalars. A type outside both lists raises ``CheckpointError`` naming it
and the file, before anything of it is built. A user who keeps their own class in a
checkpoint trusts it explicitly: ``CheckpointParameters.trusted_globals`` or
``trust_globals()``.
"""

from __future__ import annotations

import importlib
import io
import pickle
import re
from collections.abc import Iterable
from typing import Any

import torch

from dream_trainer.errors import CheckpointError

_METADATA_CLASSES = frozenset({
    "torch.distributed.checkpoint.metadata." + name for name in (
        "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
        "TensorProperties", "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING")
} | {
    "torch.distributed.checkpoint.filesystem._StorageInfo",
    "torch.Size", "torch.serialization._get_layout",
    "collections.OrderedDict", "builtins.set", "builtins.frozenset",
    # StorageMeta keeps the checkpoint id as the path it was saved to.
    "pathlib.Path", "pathlib.PosixPath", "pathlib.WindowsPath", "pathlib.PurePosixPath",
    "pathlib.PureWindowsPath",
})
"""What DCP's ``.metadata`` legitimately holds (read off real checkpoints of every layout),
besides ``torch.<dtype>``."""

_OWN = frozenset({"dream_trainer.checkpoint.state.TensorRef"})
"""What dream_trainer itself packs besides plain types: where a tensor stood in a packed value
(a frozen dataclass holding a string)."""

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


def _refusal(found: str, source: str) -> CheckpointError:
    return CheckpointError(
        f"{source} would unpickle {found}, which is not an allowed type: reading it could run "
        "code. If this checkpoint comes from a run you trust and the type is yours, allow it "
        f"with checkpoint_parameters.trusted_globals=['{found}'] (or "
        "dream_trainer.checkpoint.trust_globals)")


class _MetadataUnpickler(pickle.Unpickler):
    def __init__(self, data: bytes, source: str, trusted: frozenset[str]) -> None:
        super().__init__(io.BytesIO(data))
        self.source = source
        self.trusted = trusted

    def find_class(self, module: str, name: str) -> Any:
        found = f"{module}.{name}"
        allowed = found in _METADATA_CLASSES or found in self.trusted or (
            module == "torch" and isinstance(getattr(torch, name, None), torch.dtype))
        if not allowed:
            raise _refusal(found, self.source)
        return super().find_class(module, name)


def load_metadata(data: bytes, source: str, trusted: Iterable[str] = ()) -> Any:
    """Unpickle a DCP ``.metadata`` file's bytes through the metadata allowlist.

    Raises:
        CheckpointError: naming the first global outside the allowlist, and ``source``.
    """
    try:
        return _MetadataUnpickler(data, source, frozenset(trusted) | _TRUSTED.keys()).load()
    except CheckpointError:
        raise
    except Exception as exc:
        raise CheckpointError(f"cannot read {source}: {type(exc).__name__}: {exc}") from exc


def load_item(data: io.BytesIO | bytes, source: str, trusted: Iterable[str] = (),
              map_location: torch.device | str | None = None) -> Any:
    """``torch.load`` of a non-tensor item with torch's weights-only unpickler, which also
    accepts the trusted globals.

    Raises:
        CheckpointError: naming the global it refused, and ``source``.
    """
    stream = io.BytesIO(data) if isinstance(data, bytes) else data
    allowed = [_resolve(name) for name in sorted(frozenset(trusted) | _OWN)]
    allowed += _TRUSTED.values()
    try:
        with torch.serialization.safe_globals(allowed):
            return torch.load(stream, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as exc:
        found = re.search(r"GLOBAL (\S+)", str(exc))
        if found is None:
            raise CheckpointError(f"{source} cannot be read safely: {exc}") from exc
        raise _refusal(found.group(1).rstrip(","), source) from exc


def safe_reader(path: str, trusted: Iterable[str] = ()) -> Any:
    """A DCP ``FileSystemReader`` for ``path`` whose ``.metadata`` and non-tensor items are
    unpickled through the allowlists (``load_metadata``, ``load_item``)."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    trusted = frozenset(trusted)

    class SafeFileSystemReader(FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            metadata_path = self._get_metadata_path(kwargs.get("rank"))
            with self.fs.create_stream(metadata_path, "rb") as stream:
                metadata = load_metadata(stream.read(), str(metadata_path), trusted)
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

        def read_data(self, plan: Any, planner: Any) -> Any:
            return super().read_data(plan, _CheckedBytes(planner, path, trusted))

    return SafeFileSystemReader(path)


class _CheckedBytes:
    """The load planner, but every non-tensor item is first read by ``load_item``: the
    planner's own ``torch.load(weights_only=False)`` then only meets allowed types."""

    def __init__(self, planner: Any, path: str, trusted: frozenset[str]) -> None:
        self._planner = planner
        self._path = path
        self._trusted = trusted

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        load_item(value, f"checkpoint {self._path} (item {read_item.dest_index.fqn})",
                  self._trusted)
        value.seek(0)
        self._planner.load_bytes(read_item, value)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._planner, name)
