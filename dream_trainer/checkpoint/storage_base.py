"""Where checkpoints are, and what a checkpoint needs from the storage that holds them.

A location is a ``Path`` or an ``ObjectPath`` (a URL such as ``s3://bucket/prefix``);
``Storage`` is the operations that differ between storages. Both implementations build on
this module: ``storage.LocalStorage`` and ``object_store.ObjectStorage``, of which
``storage.storage_for`` picks the one that holds a location.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Protocol, TypeVar

from dream_trainer.errors import CheckpointError
from dream_trainer.utils.paths import component_problem


@dataclass(frozen=True)
class ObjectPath:
    """A location in an object store, ``<scheme>://<bucket>/<key prefix>``; joins with ``/``
    as a ``Path`` does, so locations of either kind are built alike."""

    url: str

    def __truediv__(self, name: str) -> ObjectPath:
        return ObjectPath(f"{self.url.rstrip('/')}/{name}")

    @property
    def name(self) -> str:
        return self.url.rstrip("/").rsplit("/", 1)[-1]

    @property
    def parent(self) -> ObjectPath:
        return ObjectPath(self.url.rstrip("/").rsplit("/", 1)[0])

    def __str__(self) -> str:
        return self.url


Location = Path | ObjectPath
"""A checkpoint's (or an experiment's) directory or file."""

L = TypeVar("L", Path, ObjectPath)


def below(directory: L, *parts: str) -> L:
    """``directory / parts[0] / parts[1] ...`` (``directory`` itself for no parts)."""
    for part in parts:
        directory = directory / part
    return directory

class RunLockLike(Protocol):
    """What the trainer needs of a run lock (``checkpoint.lock.RunLock`` and the object
    store's)."""

    def acquire(self) -> None: ...

    def release(self) -> None: ...


class Storage(ABC):
    """The operations on checkpoint files that differ between storages."""

    failures: tuple[type[BaseException], ...] = (OSError,)
    """The errors that mean a read or write of this storage failed."""

    @abstractmethod
    def is_file(self, path: Any) -> bool: ...

    @abstractmethod
    def is_dir(self, path: Any) -> bool: ...

    @abstractmethod
    def list_dir(self, path: Any) -> list[tuple[str, bool]]:
        """``(name, is a directory)`` of each entry of the directory ``path`` (none if it
        does not exist)."""

    @abstractmethod
    def read_bytes(self, path: Any) -> bytes: ...

    @abstractmethod
    def write_bytes(self, path: Any, data: bytes, mode: int = 0o644) -> None:
        """Replace the file ``path`` as a whole: a reader sees the old contents or the new.
        ``mode``: the permissions of a local file (an object store has none)."""

    @abstractmethod
    def make_dir(self, path: Any) -> None: ...

    @abstractmethod
    def remove_tree(self, path: Any) -> None:
        """Delete the directory ``path`` and all it holds; errors are ignored (retention
        tries again at the next save)."""

    @abstractmethod
    def file_size(self, path: Any) -> int:
        """The size of the regular file ``path``.

        Raises:
            CheckpointError: naming it, if it is missing, a link or not a regular file.
        """

    @abstractmethod
    def open(self, path: Any) -> IO[bytes]:
        """``path`` opened for reading, seekable; a link or non-file is refused.

        Raises:
            CheckpointError: naming the file.
        """

    @abstractmethod
    def open_size(self, file: IO[bytes]) -> int:
        """The size of a file ``open`` returned."""

    @abstractmethod
    def open_file(self, path: Any) -> IO[bytes]:
        """``path`` opened for reading, seekable, following a link: for weights that are not
        a checkpoint's (a Hugging Face cache keeps its files as links to its blobs)."""

    @abstractmethod
    def local_dir(self, target: Any,
                  replaced: Callable[[str], bool]) -> AbstractContextManager[Path]:
        """A local directory that stands for the directory ``target`` while files are
        written into it: ``target`` itself on a local filesystem. Elsewhere a temporary
        directory whose files go to ``target`` when the block ends without an error, after
        which the files of ``target`` that ``replaced(name)`` selects and that were not
        written anew are deleted (an earlier export's other shards); other files stay.

        Raises:
            CheckpointError: naming ``target`` and the fix, if the files cannot be sent.
        """

    @abstractmethod
    def writer(self, path: Any) -> Any:
        """A DCP storage writer for the checkpoint directory ``path``."""

    @abstractmethod
    def lock(self, directory: Any) -> RunLockLike:
        """The run lock of the experiment whose checkpoints are in ``directory``."""

    def free_bytes(self, path: Any) -> int | None:
        """Free space where ``path`` is written, where the storage has such a limit."""
        return None

    def access_problem(self, path: Any, probe: str | None = None) -> str | None:
        """What keeps this process from using the directory ``path`` (a missing bucket, no
        credentials, access denied, an unreachable endpoint), naming the fix; None when
        nothing does, or when only the operations themselves can tell (a local filesystem's
        errors name the path). It reads ``path``'s listing; with a ``probe`` name it also
        writes an empty object of that name in ``path`` and deletes it. A directory that
        does not exist yet is no problem."""
        return None

    def advice(self, path: Any, exc: BaseException) -> str | None:
        """What ``exc``, raised by an operation on ``path``, means and the fix, where the
        storage knows more than the error says."""
        return None

    def explain(self, path: Any, exc: BaseException) -> str:
        """``advice``, or else the error itself."""
        return self.advice(path, exc) or f"{type(exc).__name__}: {exc} (at {path})"

    def entry_size(self, directory: Any, name: Any, source: Any) -> int:
        """The size of the regular file ``name`` that ``source`` names in the checkpoint
        ``directory``.

        Raises:
            CheckpointError: if ``name`` is not a plain file name (it would reach outside the
                checkpoint), or the entry is missing, a link or not a regular file.
        """
        problem = component_problem(name)
        if problem is not None:
            raise CheckpointError(
                f"{source} names the file {name!r}, which {problem}: a checkpoint reads only "
                "files directly inside its own directory. The checkpoint was altered or "
                "crafted; do not use it")
        return self.file_size(directory / name)

    def open_inside(self, directory: Any, name: str) -> IO[bytes]:
        """The checkpoint file ``name`` of ``directory`` opened for reading (see ``open``)."""
        self.entry_size(directory, name, directory)
        return self.open(directory / name)
