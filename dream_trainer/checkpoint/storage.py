"""Where checkpoints are stored: the operations a checkpoint needs from its storage, on a
local filesystem (``LocalStorage``) or an object store (``checkpoint.object_store``).

Every other checkpoint module works on locations (a ``Path``, or an ``ObjectPath`` for a URL
such as ``s3://bucket/prefix``) and asks ``storage_for(location)`` for the rest, so that what
a checkpoint promises (complete only once its marker is written, checksums, retention, the
run lock, reading through the allowlist) is written once, for both.
"""

from __future__ import annotations

import os
import shutil
import stat
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Protocol, TypeVar

from dream_trainer.errors import CheckpointError
from dream_trainer.utils.files import make_dirs, open_dir, write_atomically
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


def location(value: str | Path | ObjectPath) -> Location:
    """``value`` as a location: a URL (``s3://...``, any ``<scheme>://``) is an
    ``ObjectPath``, anything else a local ``Path``."""
    if isinstance(value, (Path, ObjectPath)):
        return value
    return ObjectPath(value) if "://" in value else Path(value)


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


class LocalStorage(Storage):
    """A local (or mounted) filesystem. Files are replaced by rename, opened without
    following symlinks, checkpoint directories are created and written without following
    one (``checkpoint.no_follow``), and the run lock is an OS lock
    (``checkpoint.lock.RunLock``)."""

    def is_file(self, path: Path) -> bool:
        return path.is_file()

    def is_dir(self, path: Path) -> bool:
        return path.is_dir()

    def list_dir(self, path: Path) -> list[tuple[str, bool]]:
        if not path.is_dir():
            return []
        return [(entry.name, entry.is_dir()) for entry in path.iterdir()]

    def read_bytes(self, path: Path) -> bytes:
        return path.read_bytes()

    def write_bytes(self, path: Path, data: bytes, mode: int = 0o644) -> None:
        write_atomically(path, data, mode)

    def make_dir(self, path: Path) -> None:
        make_dirs(path.parent)
        path.mkdir(exist_ok=True)
        # A link planted as the checkpoint directory is refused, never written through.
        os.close(open_dir(path))

    def remove_tree(self, path: Path) -> None:
        if path.is_symlink():  # a link where a directory goes: it goes, its target stays
            path.unlink(missing_ok=True)
        else:
            shutil.rmtree(path, ignore_errors=True)

    def file_size(self, path: Path) -> int:
        try:
            entry = path.lstat()
        except FileNotFoundError:
            raise CheckpointError(f"checkpoint file {path} is missing") from None
        if stat.S_ISLNK(entry.st_mode):
            raise CheckpointError(
                f"checkpoint file {path} is a symbolic link (to {os.readlink(path)}): a "
                "checkpoint reads only regular files inside its directory. Replace the link "
                "with the file itself (cp -L), if you trust it")
        if not stat.S_ISREG(entry.st_mode):
            raise CheckpointError(f"checkpoint file {path} is not a regular file")
        return entry.st_size

    def open(self, path: Path) -> IO[bytes]:
        try:
            descriptor = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        except OSError as exc:
            self.file_size(path)  # names it: missing, a link, not a file
            raise CheckpointError(f"cannot open checkpoint file {path}: {exc}") from exc
        if not stat.S_ISREG(os.fstat(descriptor).st_mode):
            os.close(descriptor)
            self.file_size(path)
            raise CheckpointError(f"checkpoint file {path} is not a regular file")
        return os.fdopen(descriptor, "rb")

    def open_inside(self, directory: Path, name: str) -> IO[bytes]:
        # One open, no separate check: the descriptor is the file that was checked.
        problem = component_problem(name)
        if problem is not None:
            self.entry_size(directory, name, directory)
        return self.open(directory / name)

    def open_size(self, file: IO[bytes]) -> int:
        return os.fstat(file.fileno()).st_size

    def open_file(self, path: Path) -> IO[bytes]:
        return path.open("rb")

    @contextmanager
    def local_dir(self, target: Path, replaced: Callable[[str], bool]) -> Iterator[Path]:
        yield target  # written in place: the writers replace files by rename

    def writer(self, path: Path) -> Any:
        from dream_trainer.checkpoint.no_follow import NoFollowWriter

        return NoFollowWriter(str(path))

    def lock(self, directory: Path) -> RunLockLike:
        from dream_trainer.checkpoint.lock import RunLock

        return RunLock(directory)

    def free_bytes(self, path: Path) -> int | None:
        return shutil.disk_usage(path).free if path.exists() else None


_LOCAL = LocalStorage()


def storage_for(path: Any) -> Storage:
    """The storage that holds ``path``: an ``ObjectPath``'s object store (its client is
    imported on first use), else the local filesystem."""
    if isinstance(path, ObjectPath):
        from dream_trainer.checkpoint.object_store import object_storage

        return object_storage(path)
    return _LOCAL
