"""Where HangWatchdog's files go, and how they are written: never through a planted symlink.

The default directory is private: ``<temp>/dream_trainer-<uid>/<project>/<group>/<experiment>
/hang``, whose first component is created with mode 0700 and refused unless it is a real
directory owned by this user that no other user can enter. A shared temporary directory is
open to every user, who could otherwise plant ``hang_rank0.json -> ~/.bashrc`` there and have
the watchdog write through it. Every file is written to a fresh name (created with
``O_EXCL``, which also refuses a symlink) and renamed into place: a rename replaces a symlink
rather than following it.
"""

from __future__ import annotations

import os
import stat
import tempfile
from pathlib import Path

from dream_trainer.utils.files import open_dir, write_atomically


def private_trace_dir(project: str, group: str, experiment: str) -> Path:
    """The run's own directory under this user's private directory in the system's temporary
    directory; the private one is created now, the run's when a file is first written to it.
    Every rank of a run on one host names the same directory.

    Raises:
        PermissionError: if ``<temp>/dream_trainer-<uid>`` exists but is a symlink, not a
            directory, another user's, or open to other users.
    """
    base = _private_base()
    try:
        base.mkdir(mode=0o700)
    except FileExistsError:
        pass
    problem = _not_private(base)
    if problem is not None:
        raise PermissionError(
            f"HangWatchdog: {base} {problem}, so another user could redirect or read the "
            "hang records written there; remove it (it is recreated private), or pass "
            "HangWatchdog(trace_dir=...) a directory of your own")
    return base / project / group / experiment / "hang"


def _private_base() -> Path:
    return Path(tempfile.gettempdir()) / f"dream_trainer-{os.getuid()}"


def _not_private(path: Path) -> str | None:
    """Why ``path`` is not a directory only this user can enter, or None if it is one."""
    info = os.lstat(path)  # lstat: a symlink must be seen as one, not as its target
    if stat.S_ISLNK(info.st_mode):
        return "is a symbolic link"
    if not stat.S_ISDIR(info.st_mode):
        return "is not a directory"
    if info.st_uid != os.getuid():
        return f"belongs to user id {info.st_uid}, not to this user ({os.getuid()})"
    if info.st_mode & 0o077:
        return f"has mode {stat.S_IMODE(info.st_mode):o}, which lets other users in (0700 does not)"
    return None


def write_file(directory: Path, name: str, data: bytes) -> Path:
    """Write ``data`` to ``directory/name`` (created with mode 0700 if missing) as a whole,
    readable by this user only: an existing ``name`` (a symlink included) is replaced, never
    written through (``write_atomically``), and a link planted as ``directory``, as a
    component of it that is created, or as any component below the private directory
    (``private_trace_dir``) is refused (``utils.files.open_dir``).

    Returns:
        The path written.

    Raises:
        LinkRefused: naming the link.
    """
    # Below the private directory nothing may be a link; elsewhere, the directory itself
    # and what is created here.
    descriptor = open_dir(directory, create=True, mode=0o700, root=_private_base())
    try:
        return write_atomically(directory / name, data, mode=0o600, directory=descriptor)
    finally:
        os.close(descriptor)
