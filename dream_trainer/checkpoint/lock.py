"""One run at a time per experiment: an OS lock on a file in its checkpoint directory, and a
record in that file naming the run that holds it (``checkpoint.lock_holder``)."""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import stat
import time
from abc import ABC, abstractmethod
from dataclasses import asdict
from pathlib import Path
from typing import Any

from dream_trainer.checkpoint.lock_holder import LockHolder
from dream_trainer.errors import CheckpointError
from dream_trainer.utils.files import LinkRefused, make_dirs, write_atomically

logger = logging.getLogger(__name__)

LOCK = ".lock"
TAKEOVER = ".lock.takeover"

# The lock file is opened, read and created without following a link: a link planted under
# its name (by whoever can write the checkpoint directory) would have the run write its record
# into the linked file.
_OPEN = os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC

# Errors of flock() on a filesystem that has no locks (NFS mounted without lockd, Lustre
# without its flock option): the record alone then decides.
_NO_OS_LOCKS = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL)

# A winner writes its record right after taking the OS lock: a loser reading the file in
# that moment sees the dead holder's record (or none), so it reads again for a while.
_RECORD_WAIT_S = 2.0

# The descriptors whose OS lock this process holds. A forked child (a DataLoader worker)
# shares the open file and would keep the lock after the run died; it closes its copies.
_HELD: set[int] = set()


def _close_inherited() -> None:
    for descriptor in _HELD:
        os.close(descriptor)
    _HELD.clear()


os.register_at_fork(after_in_child=_close_inherited)


class RecordLock(ABC):
    """The take-over both run locks share (``RunLock`` on a filesystem without OS locks,
    and the object store's ``ObjectLock``): a record judged dead is replaced by this run's
    only by the run that creates ``.lock.takeover`` beside it, so that of several runs taking
    over one dead lock exactly one wins. A subclass gives its storage's primitives.

    Attributes:
        path: The lock's file or object, ``<checkpoint directory>/.lock``.
        holder: This process, as its record names it.
    """

    path: Any
    holder: LockHolder
    _delete_word = "remove"
    """The word for deleting what is left behind in this storage's messages."""

    def _replace_dead(self, current: LockHolder) -> None:
        """Replace the record ``current``, judged dead, by this run's.

        Raises:
            CheckpointError: if another run is taking the lock over at this moment, or the
                record is no longer ``current`` (a run that came first replaced it).
        """
        marker = self.path.parent / TAKEOVER
        if not self._create(marker):
            raise CheckpointError(
                f"another run is taking over the lock on {self.path.parent} at this moment "
                f"(from {current.describe()}); if none is, {self._delete_word} {marker}")
        try:
            # Only the run that created the marker may replace the record, and only the
            # record it judged dead: a run that came first has replaced it already.
            now = self._read_record()
            if now != current:
                raise self._changed(now)
            self._log_takeover(current)
            self._replace_record()
        finally:
            self._delete(marker)

    def _record(self) -> bytes:
        """This run's record, as the lock holds it."""
        return json.dumps(asdict(self.holder)).encode()

    def _log_takeover(self, current: LockHolder) -> None:
        if current.same_launcher(self.holder):
            logger.info("taking over the lock of an earlier worker of this run (%s)",
                        current.describe())
        else:
            logger.warning("taking over the lock on %s from a run that is no longer "
                           "running (%s)", self.path.parent, current.describe())

    def _changed(self, now: LockHolder | str | None) -> CheckpointError:
        """The refusal when the record judged dead was replaced by ``now`` meanwhile."""
        return self._refusal(now or "its record is gone (its holder released it)")

    @abstractmethod
    def _create(self, path: Any) -> bool:
        """Create ``path`` if nothing is there; whether this call created it."""

    @abstractmethod
    def _read_record(self) -> LockHolder | str | None:
        """The holder the lock names, why its record is unreadable, or None without one."""

    @abstractmethod
    def _replace_record(self) -> None:
        """Replace the lock's record, as a whole, by this run's."""

    @abstractmethod
    def _delete(self, path: Any) -> None:
        """Delete ``path``, which this run created."""

    @abstractmethod
    def _refusal(self, current: LockHolder | str | None,
                 note: str | None = None) -> CheckpointError:
        """The error naming the run that holds the lock (``current``)."""


class RunLock(RecordLock):
    """An exclusive claim by one run on an experiment's checkpoint directory.

    ``acquire()`` takes an OS lock (``flock``) on ``<directory>/.lock``, held until
    ``release()`` or the process's death, and writes into the file who holds it (host, pid,
    start time, kernel boot id, PID namespace). A lock whose OS lock another process holds is
    refused with an error naming the holder. A free OS lock whose record names a process on
    this kernel means that process is dead: its lock is taken over, with a warning unless it
    was an earlier worker of the same torchrun agent (a restart of this very run). A holder on
    another kernel cannot be checked (the filesystem may not share locks between machines),
    so its lock is refused: remove the file once that run is known to be gone.

    Where the filesystem has no OS locks, the record decides alone: a holder is dead when its
    pid is gone from this machine's PID namespace, a holder in another namespace or on
    another kernel is refused, and a takeover goes through the exclusive creation of
    ``.lock.takeover``, so that of several runs taking over one dead lock exactly one wins.

    Args:
        directory: The experiment's checkpoint directory.
    """

    def __init__(self, directory: Path) -> None:
        self.path = directory / LOCK
        self.holder = LockHolder.this_process()
        self.held = False
        self._descriptor: int | None = None

    def acquire(self) -> None:
        """Take the lock.

        Raises:
            CheckpointError: naming the holder, if another live run (or a run that cannot be
                checked from here) holds it; naming the file, if its directory is not
                writable or, without OS locks, its record is unreadable.
        """
        try:
            make_dirs(self.path.parent)
            while not self.held:
                self._attempt()
        except LinkRefused as exc:
            raise CheckpointError(f"cannot use the checkpoint directory: {exc}") from None
        except OSError as exc:
            # Found at setup, not after hours of training at the first save.
            raise CheckpointError(
                f"cannot write to the checkpoint directory {self.path.parent}: "
                f"{type(exc).__name__}: {exc}; give it a writable root_dir"
            ) from exc

    def release(self) -> None:
        """Remove the lock file if this run still holds it, and free the OS lock."""
        if not self.held:
            return
        self.held = False
        descriptor, self._descriptor = self._descriptor, None
        if descriptor is None:
            try:
                ours = self._wait_for_record(live=False) == self.holder
            except CheckpointError:
                ours = False  # a link or other file put in its place: not ours to remove
            if ours:
                self.path.unlink(missing_ok=True)
            return
        if descriptor not in _HELD:
            return  # a forked child: the lock is its parent's
        _HELD.discard(descriptor)
        try:
            # The path names another file if the user removed ours and another run then
            # created its own: that one stays.
            if _names(self.path, descriptor):
                self.path.unlink()
        finally:
            os.close(descriptor)

    def _attempt(self) -> None:
        """One try: hold the lock, raise, or return without it when the file vanished
        meanwhile (its holder released it), to try again."""
        try:
            descriptor = os.open(self.path, _OPEN | os.O_CREAT | os.O_EXCL, 0o644)
            created = True
        except FileExistsError:
            descriptor = self._open()
            if descriptor is None:
                return
            created = False
        try:
            fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            os.close(descriptor)
            if isinstance(exc, BlockingIOError):
                current = self._wait_for_record(live=True)
                dead = isinstance(current, LockHolder) and current.is_alive(self.holder) is False
                raise self._refusal(current, "it is no longer running, but a process it started "
                                    "still holds the file's OS lock" if dead else None) from None
            if exc.errno not in _NO_OS_LOCKS:
                raise
            logger.warning("the filesystem of %s has no file locks (%s): the run lock relies "
                           "on its record alone", self.path.parent, exc)
            if created:
                # By rename, as a takeover writes it: never through a link put in its place.
                self._replace_record()
                self.held = True
            else:
                self._take_over_by_record()
            return
        try:
            # A holder releasing removes the file, then unlocks it: a lock taken on the
            # removed file excludes no one.
            if _names(self.path, descriptor):
                self._take_over(_read(descriptor))
                _write(descriptor, self.holder)
                self._descriptor = descriptor
                _HELD.add(descriptor)
                self.held = True
        finally:
            if not self.held:
                os.close(descriptor)

    def _open(self) -> int | None:
        """The existing lock file, opened without following a link; None if it vanished.

        Raises:
            CheckpointError: if it is a link or not a regular file.
        """
        try:
            descriptor = os.open(self.path, _OPEN)
        except FileNotFoundError:
            return None
        except OSError as exc:
            if os.path.islink(self.path):
                raise self._not_a_file("a symbolic link") from None
            if exc.errno == errno.EISDIR:
                raise self._not_a_file("a directory") from None
            raise
        if not stat.S_ISREG(os.fstat(descriptor).st_mode):
            os.close(descriptor)
            raise self._not_a_file("not a regular file")
        return descriptor

    def _not_a_file(self, what: str) -> CheckpointError:
        return CheckpointError(
            f"the run lock {self.path} is {what}: a run writes its record only into a "
            "regular file there, never through a link (whoever can write the checkpoint "
            "directory could otherwise have it overwrite another file). Delete it; the "
            "next run creates it anew")

    # -- with OS locks ------------------------------------------------------------------------
    def _take_over(self, text: str) -> None:
        """Decide on the record of a lock whose OS lock is now ours: no live process on this
        kernel holds it, but a holder on another kernel cannot be ruled out."""
        if not text:
            return
        try:
            current = LockHolder.parse(text)
        except ValueError as exc:
            logger.warning("taking over the lock on %s, whose record %s is unreadable (%s) "
                           "and which no process on this machine holds", self.path.parent,
                           self.path, exc)
            return
        if not current.same_kernel(self.holder):
            raise self._refusal(current, self._unchecked(current))
        self._log_takeover(current)

    # -- without OS locks ---------------------------------------------------------------------
    def _take_over_by_record(self) -> None:
        """Take over the lock if its record names a dead process, through the exclusive
        creation of a marker; return without it if the file vanished meanwhile."""
        current = self._wait_for_record(live=False)
        if current is None:
            return
        if isinstance(current, str):
            raise CheckpointError(
                f"{current}, and this filesystem has no file locks to tell whether a run "
                f"holds it: remove it once no run writes to {self.path.parent}")
        alive = current.is_alive(self.holder)
        if alive is not False:
            raise self._refusal(current, None if alive else self._unchecked(current))
        self._replace_dead(current)
        self.held = True

    def _create(self, path: Path) -> bool:
        try:
            os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_NOFOLLOW
                             | os.O_CLOEXEC, 0o644))
        except FileExistsError:
            return False
        return True

    def _read_record(self) -> LockHolder | str | None:
        return self._wait_for_record(live=False)

    def _replace_record(self) -> None:
        write_atomically(self.path, self._record())

    def _delete(self, path: Path) -> None:
        path.unlink()

    def _wait_for_record(self, live: bool) -> LockHolder | str | None:
        """The holder the lock file names, why its record is unreadable, or None without a
        file. A record is read again for a while if unreadable (a holder writing it), and
        with ``live`` while it names a dead process (the holder took it over a moment ago)."""
        deadline = time.monotonic() + _RECORD_WAIT_S
        while True:
            descriptor = self._open()
            if descriptor is None:
                current: LockHolder | str | None = None
            else:
                try:
                    current = LockHolder.parse(_read(descriptor))
                except ValueError as exc:
                    current = f"the lock file {self.path} is unreadable ({exc})"
                finally:
                    os.close(descriptor)
            settled = not isinstance(current, str) and not (
                live and isinstance(current, LockHolder)
                and current.is_alive(self.holder) is False)
            if settled or time.monotonic() > deadline:
                return current
            time.sleep(0.02)

    # -- both ---------------------------------------------------------------------------------
    def _unchecked(self, current: LockHolder) -> str:
        return f"{current.unverifiable(self.holder)}, so whether it still runs cannot be " \
               "checked from here"

    def _refusal(self, current: LockHolder | str | None,
                 note: str | None = None) -> CheckpointError:
        if current is None:
            holder = "its record is gone (its holder was releasing it)"
        elif isinstance(current, str):
            holder = current
        else:
            holder = current.describe()
        return CheckpointError(
            f"another run holds the lock on {self.path.parent}: {holder}"
            f"{'' if note is None else f' ({note})'}. Two runs "
            "writing one experiment's checkpoints would delete and resume each other's: stop "
            "that run (under torchrun, its workers too: killing torchrun alone leaves them "
            f"running), use another experiment name or root_dir, or remove {self.path} if that "
            "run is gone"
        )


def _names(path: Path, descriptor: int) -> bool:
    """Whether ``path`` is the file open as ``descriptor``."""
    try:
        return os.path.samestat(os.fstat(descriptor), os.stat(path, follow_symlinks=False))
    except FileNotFoundError:
        return False


def _read(descriptor: int) -> str:
    """The whole text of the file open as ``descriptor``, without moving or closing it (a
    second open and close is harmless to ``flock``, but not to the POSIX locks NFS maps it
    to)."""
    # A record is a few hundred bytes; a planted huge file reads as an unreadable record.
    size = min(os.fstat(descriptor).st_size, _MAX_RECORD_BYTES)
    return os.pread(descriptor, size, 0).decode(errors="replace")


_MAX_RECORD_BYTES = 1 << 16
"""The most of a lock file read (64 KiB): a record is a few hundred bytes."""


def _write(descriptor: int, holder: LockHolder) -> None:
    data = json.dumps(asdict(holder)).encode()
    os.pwrite(descriptor, data, 0)
    os.ftruncate(descriptor, len(data))
