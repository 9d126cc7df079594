"""One run at a time per experiment: a lock file in its checkpoint directory."""

from __future__ import annotations

import json
import logging
import os
import socket
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from dream_trainer.checkpoint.layout import CheckpointError

logger = logging.getLogger(__name__)

LOCK = ".lock"


@dataclass(frozen=True)
class LockHolder:
    """Who holds an experiment's lock: the process of global rank 0 of a run.

    ``launcher_pid`` is the process that started it (torchrun's agent, or a shell): workers
    that torchrun restarts have the same one, which is how a restart of the same run is told
    from another run.
    """

    host: str
    pid: int
    started: str
    process_start: int | None
    launcher_pid: int

    @classmethod
    def this_process(cls) -> LockHolder:
        return cls(socket.gethostname(), os.getpid(),
                   time.strftime("%Y-%m-%d %H:%M:%S %z"), _process_start(os.getpid()),
                   os.getppid())

    def describe(self) -> str:
        return f"pid {self.pid} on host {self.host}, started {self.started}"

    def is_alive(self) -> bool | None:
        """Whether the holder still runs; None when that cannot be told (another host)."""
        if self.host != socket.gethostname():
            return None
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            pass  # it exists, under another user
        # A recycled pid belongs to a process that started at another time.
        start = _process_start(self.pid)
        return start is None or self.process_start is None or start == self.process_start


class RunLock:
    """An exclusive claim by one run on an experiment's checkpoint directory.

    ``acquire()`` creates ``<directory>/.lock`` naming this process (host, pid, start time). A
    lock held by a live process is refused with an error naming it; a lock whose holder is
    dead on this host is taken over, with a warning unless the holder was an earlier worker
    of the same torchrun agent (a restart of this very run). A holder on another host cannot
    be checked, so its lock is refused: remove the file once that run is known to be gone.

    Args:
        directory: The experiment's checkpoint directory.
    """

    def __init__(self, directory: Path) -> None:
        self.path = directory / LOCK
        self.holder = LockHolder.this_process()
        self.held = False

    def acquire(self) -> None:
        """Take the lock.

        Raises:
            CheckpointError: naming the holder, if another live run (or a run on another
                host) holds it.
        """
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            if self._create():
                return
        except OSError as exc:
            # Found at setup, not after hours of training at the first save.
            raise CheckpointError(
                f"cannot write to the checkpoint directory {self.path.parent}: "
                f"{type(exc).__name__}: {exc}; give it a writable root_dir"
            ) from exc
        current = self._read()
        if current is not None:
            alive = current.is_alive()
            if alive is not False:
                where = "" if alive else (" (on another host, so whether it still runs cannot "
                                          "be checked from here)")
                raise CheckpointError(
                    f"another run holds the lock on {self.path.parent}: {current.describe()}"
                    f"{where}. Two runs writing one experiment's checkpoints would delete and "
                    "resume each other's: stop that run (under torchrun, its workers too: "
                    "killing torchrun alone leaves them running), use another experiment name "
                    f"or root_dir, or remove {self.path} if that run is gone"
                )
            if current.launcher_pid == self.holder.launcher_pid \
                    and current.host == self.holder.host:
                logger.info("taking over the lock of an earlier worker of this run (%s)",
                            current.describe())
            else:
                logger.warning("taking over the lock on %s from a run that is no longer "
                               "running (%s)", self.path.parent, current.describe())
        self._write()

    def release(self) -> None:
        """Remove the lock file if this run still holds it."""
        if not self.held:
            return
        self.held = False
        current = self._read()
        if current is not None and (current.host, current.pid) == (self.holder.host,
                                                                    self.holder.pid):
            self.path.unlink(missing_ok=True)

    def _create(self) -> bool:
        try:
            descriptor = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return False
        with os.fdopen(descriptor, "w") as file:
            json.dump(asdict(self.holder), file)
        self.held = True
        return True

    def _write(self) -> None:
        temporary = self.path.with_name(f"{LOCK}.{self.holder.pid}")
        temporary.write_text(json.dumps(asdict(self.holder)))
        os.replace(temporary, self.path)
        # Two runs taking over one dead lock at once: the rename that came last wins.
        winner = self._read()
        if winner != self.holder:
            raise CheckpointError(f"another run took the lock on {self.path.parent} at the "
                                  f"same moment: {winner.describe() if winner else 'unknown'}")
        self.held = True

    def _read(self) -> LockHolder | None:
        try:
            return LockHolder(**json.loads(self.path.read_text()))
        except FileNotFoundError:
            return None
        except (ValueError, TypeError) as exc:
            logger.warning("ignoring an unreadable lock file %s: %s", self.path, exc)
            return None


def _process_start(pid: int) -> int | None:
    """When ``pid`` started, in clock ticks since boot (Linux); None where unknown."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # The command name (field 2) may hold spaces and parentheses: count from its end.
    return int(stat.rsplit(")", 1)[1].split()[19])
