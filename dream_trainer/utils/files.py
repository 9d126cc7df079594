"""Writing inside run and export folders without following a link: replacing a file as a whole
(a reader sees the old contents or the new, never a part; a symlink planted under the name is
replaced, never written through), creating and opening directories and files so that a link
planted in their place is refused, never followed."""

from __future__ import annotations

import errno
import os
import secrets
import stat
from pathlib import Path
from typing import IO


def write_atomically(path: Path, data: bytes, mode: int = 0o644,
                     directory: int | None = None) -> Path:
    """Write ``data`` to a fresh name beside ``path`` (created with ``O_EXCL|O_NOFOLLOW``, so
    no existing file or link is opened), flush it to disk, and rename it over ``path``.

    Args:
        path: The file to replace; its directory must exist.
        data: Its new contents.
        mode: The permissions of a new file (0o600 for one only its owner may read).
        directory: A descriptor of ``path``'s directory (``open_dir``): the file is then
            written and renamed relative to it, so that a link put in the directory's place
            meanwhile is not followed.

    Returns:
        ``path``.
    """
    temporary = path.with_name(f".{path.name}.{secrets.token_hex(8)}.tmp")
    # Names relative to ``directory``, or full paths without one.
    source, target = (temporary.name, path.name) if directory is not None else (temporary, path)
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    descriptor = os.open(source, flags, mode, dir_fd=directory)
    try:
        with os.fdopen(descriptor, "wb") as file:
            file.write(data)
            file.flush()
            os.fsync(file.fileno())
        os.replace(source, target, src_dir_fd=directory, dst_dir_fd=directory)
    except BaseException:
        try:
            os.unlink(source, dir_fd=directory)
        except FileNotFoundError:
            pass
        raise
    return path


class LinkRefused(PermissionError):
    """A symbolic link stands where a run or an export writes: it is never followed."""


_DIRECTORY = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def refused_link(path: Path) -> LinkRefused:
    """The error for a link found at ``path``, naming it and the fix."""
    try:
        target = f" (to {os.readlink(path)})"
    except OSError:
        target = ""
    return LinkRefused(
        f"{path} is a symbolic link{target}: dream_trainer never follows a link inside a "
        "run or export folder, since whoever can write that folder could redirect its "
        "writes through it; delete it (what belongs there is created anew)")


def open_dir(path: Path, create: bool = False, mode: int = 0o777, follow: bool = False,
             root: Path | None = None) -> int:
    """A descriptor of the directory ``path``, opened without following a link: its last
    component, every component created here and every component below ``root`` must be
    real directories (an existing ancestor above them is taken as the user named it, a
    directory on a linked mount included).

    Args:
        path: The directory.
        create: Create the missing components (with ``mode``), as ``mkdir -p`` does.
        mode: The permissions of a created directory (before the umask).
        follow: Take an existing ``path`` as named too (a directory the user chose, such
            as an export's OUT_DIR, may be a link); only what is created is checked.
        root: The folder the user chose that ``path`` lies in (a run's ``root_dir``): no
            component below it may be a link, an existing one included.

    Returns:
        A descriptor (``O_DIRECTORY|O_NOFOLLOW|O_CLOEXEC``) the caller closes.

    Raises:
        LinkRefused: naming the link, if one stands at such a component.
        OSError: as ``os.open`` and ``os.mkdir`` raise them otherwise (a missing directory
            without ``create``, a file in the way).
    """
    parts = Path(os.path.abspath(path)).parts
    existing = len(parts) if follow else len(parts) - 1
    if root is not None:
        root_parts = Path(os.path.abspath(root)).parts
        if parts[:len(root_parts)] == root_parts:
            existing = min(existing, len(root_parts))
    while existing > 1 and not os.path.isdir(Path(*parts[:existing])):
        existing -= 1
    descriptor = os.open(Path(*parts[:existing]), _DIRECTORY & ~os.O_NOFOLLOW)
    try:
        for depth in range(existing, len(parts)):
            name = parts[depth]
            if create:
                try:
                    os.mkdir(name, mode, dir_fd=descriptor)
                except FileExistsError:
                    pass
            child = open_inside(descriptor, name, Path(*parts[:depth + 1]))
            os.close(descriptor)
            descriptor = child
    except BaseException:
        os.close(descriptor)
        raise
    return descriptor


def open_inside(directory: int, name: str, shown: Path) -> int:
    """The directory ``name`` of the directory open as ``directory``, opened without
    following a link (``shown`` names it in errors).

    Raises:
        LinkRefused: if ``name`` is a link.
        OSError: if it is missing or not a directory.
    """
    try:
        return os.open(name, _DIRECTORY, dir_fd=directory)
    except OSError as exc:
        # O_NOFOLLOW|O_DIRECTORY on a link fails with ELOOP (or ENOTDIR on some systems).
        if exc.errno in (errno.ELOOP, errno.ENOTDIR) and _is_link(directory, name):
            raise refused_link(shown) from None
        raise


def _is_link(directory: int, name: str) -> bool:
    try:
        return stat.S_ISLNK(os.stat(name, dir_fd=directory, follow_symlinks=False).st_mode)
    except OSError:
        return False


def make_dirs(path: Path, mode: int = 0o777, root: Path | None = None) -> Path:
    """``mkdir -p path`` that refuses a link as ``path``, as a component it creates or as
    one below ``root`` (see ``open_dir``).

    Returns:
        ``path``.
    """
    os.close(open_dir(path, create=True, mode=mode, root=root))
    return path


def open_file(path: Path, flags: int, mode: int = 0o644) -> int:
    """``os.open(path, flags | O_NOFOLLOW | O_CLOEXEC)`` that names a link planted as
    ``path`` (``LinkRefused``) and refuses anything but a regular file (``OSError``).

    Returns:
        The descriptor, which the caller closes.
    """
    try:
        descriptor = os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
    except OSError as exc:
        if exc.errno == errno.ELOOP and os.path.islink(path):
            raise refused_link(path) from None
        raise
    if not stat.S_ISREG(os.fstat(descriptor).st_mode):
        os.close(descriptor)
        raise IsADirectoryError(errno.EISDIR, "not a regular file: delete it", str(path))
    return descriptor


def append_text(path: Path, newline: str | None = None) -> IO[str]:
    """``path`` opened to append text (created if missing), never through a link (see
    ``open_file``); ``newline`` as ``open`` takes it."""
    descriptor = open_file(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    return os.fdopen(descriptor, "a", newline=newline)


def read_text(path: Path, newline: str | None = None) -> IO[str]:
    """``path`` opened to read text, never through a link (see ``open_file``)."""
    return os.fdopen(open_file(path, os.O_RDONLY), newline=newline)
