"""DCP's ``FileSystemWriter``, writing a checkpoint directory without following a link.

Whoever can write the checkpoint directory could plant a link as ``step_<N>`` (or as a file
inside it) while a save runs, and have the save write through it into another directory.
Here the step directory is created and opened without following a link (``utils.files``),
and every file is created, renamed and removed relative to that directory's descriptor, with
``O_NOFOLLOW``: a planted link is refused (or, for a rename, replaced), never followed.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.filesystem import FileSystem

from dream_trainer.utils.files import make_dirs, open_dir, refused_link

_WRITE = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC


class _NoFollowFileSystem(FileSystem):
    """DCP's local filesystem, writing only through descriptors opened without following a
    link: the files of a checkpoint lie directly in its directory."""

    @contextmanager
    def create_stream(self, path: str | os.PathLike[str], mode: str) -> Iterator[Any]:
        if "w" not in mode:
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        path = Path(path)
        directory = open_dir(path.parent)
        try:
            descriptor = os.open(path.name, _WRITE, 0o644, dir_fd=directory)
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise refused_link(path) from None
            raise
        finally:
            os.close(directory)
        with os.fdopen(descriptor, mode) as stream:
            yield stream

    def rename(self, path: str | os.PathLike[str], new_path: str | os.PathLike[str]) -> None:
        path, new_path = Path(path), Path(new_path)
        directory = open_dir(path.parent)
        try:
            # Within the one directory: a link under the new name is replaced, not followed.
            os.replace(path.name, new_path.name, src_dir_fd=directory, dst_dir_fd=directory)
        finally:
            os.close(directory)

    def mkdir(self, path: str | os.PathLike[str]) -> None:
        make_dirs(Path(path))

    def rm_file(self, path: str | os.PathLike[str]) -> None:
        path = Path(path)
        directory = open_dir(path.parent)
        try:
            os.unlink(path.name, dir_fd=directory)
        finally:
            os.close(directory)


class NoFollowWriter(FileSystemWriter):
    """A ``FileSystemWriter`` that never writes through a link (see the module).

    Args:
        path: The checkpoint directory.
    """

    def __init__(self, path: str | os.PathLike[str], **kwargs: Any) -> None:
        super().__init__(path, **kwargs)
        self.fs = _NoFollowFileSystem()
        self.path = self.fs.init_path(path)
