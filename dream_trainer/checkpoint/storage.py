"""Where checkpoints are stored: a location's storage (``storage_for``), and the local
filesystem's (``LocalStorage``); an object store's is ``checkpoint.object_store``.

Every other checkpoint module works on locations (a ``Path``, or an ``ObjectPath`` for a URL
such as ``s3://bucket/prefix``, ``checkpoint.storage_base``) and asks
``storage_for(location)`` for the rest, so that what a checkpoint promises (complete only
once its marker is written, checksums, retention, the run lock, reading through the
allowlist) is written once, for both.
"""

from __future__ import annotations

import os
import shutil
import stat
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

from dream_trainer.checkpoint.storage_base import Location, ObjectPath, RunLockLike, Storage
from dream_trainer.errors import CheckpointError
from dream_trainer.utils.files import make_dirs, open_dir, write_atomically
from dream_trainer.utils.paths import component_problem


def location(value: str | Path | ObjectPath) -> Location:
    """``value`` as a location: a URL (``s3://...``, any ``<scheme>://``) is an
    ``ObjectPath``, anything else a local ``Path``."""
    if isinstance(value, (Path, ObjectPath)):
        return value
    return ObjectPath(value) if "://" in value else Path(value)


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
