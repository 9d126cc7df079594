"""``LockHolder``: the record a run lock holds, naming the run that holds it, and whether
that run still runs, as far as this machine can tell."""

from __future__ import annotations

import json
import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path

# Each field of a record, with the types a valid one holds. Records of versions before the
# OS lock lack the last two: they read as unknown.
_FIELDS: dict[str, tuple[type, ...]] = {
    "host": (str,), "pid": (int,), "started": (str,), "process_start": (int, type(None)),
    "launcher_pid": (int,), "boot_id": (str, type(None)), "pid_namespace": (str, type(None)),
}
_ADDED = ("boot_id", "pid_namespace")


@dataclass(frozen=True)
class LockHolder:
    """Who holds an experiment's lock: the process of global rank 0 of a run.

    ``launcher_pid`` is the process that started it (torchrun's agent, or a shell): workers
    that torchrun restarts have the same one, which is how a restart of the same run is told
    from another run. ``boot_id`` names the running kernel and ``pid_namespace`` the set of
    process ids ``pid`` belongs to (a container has its own).
    """

    host: str
    pid: int
    started: str
    process_start: int | None
    launcher_pid: int
    boot_id: str | None
    pid_namespace: str | None

    @classmethod
    def this_process(cls) -> LockHolder:
        return cls(socket.gethostname(), os.getpid(),
                   time.strftime("%Y-%m-%d %H:%M:%S %z"), _process_start(os.getpid()),
                   os.getppid(), _boot_id(), _pid_namespace())

    @classmethod
    def parse(cls, text: str) -> LockHolder:
        """The holder a lock file's text names.

        Raises:
            ValueError: naming what is wrong (not JSON, a missing field, a field's type).
        """
        record = json.loads(text)
        if not isinstance(record, dict):
            raise ValueError(f"expected a JSON object, found {type(record).__name__}")
        for name, types in _FIELDS.items():
            if name not in record and name not in _ADDED:
                raise ValueError(f"field {name!r} is missing")
            value = record.get(name)
            # bool is an int to isinstance, but never a pid.
            if not isinstance(value, types) or isinstance(value, bool):
                raise ValueError(f"field {name!r} is {value!r}, not of type "
                                 + " or ".join(t.__name__ for t in types))
        return cls(**{name: record.get(name) for name in _FIELDS})

    def describe(self) -> str:
        return f"pid {self.pid} on host {self.host}, started {self.started}"

    def same_kernel(self, other: LockHolder) -> bool:
        """Whether both run on one kernel (one boot of one machine, any container of it)."""
        if self.boot_id is not None and other.boot_id is not None:
            return self.boot_id == other.boot_id
        return self.host == other.host

    def same_launcher(self, other: LockHolder) -> bool:
        """Whether both were started by one process: workers of one torchrun agent."""
        return self.same_kernel(other) and self.pid_namespace == other.pid_namespace \
            and self.launcher_pid == other.launcher_pid

    def unverifiable(self, observer: LockHolder) -> str | None:
        """Why ``observer`` cannot tell from the pid whether this holder runs, or None."""
        if not self.same_kernel(observer):
            return "on another host" if self.host != observer.host else (
                "on another kernel with this host name (another machine, or this one before "
                "a restart)")
        if self.pid_namespace != observer.pid_namespace:
            return "in another PID namespace (another container) on this machine"
        return None

    def is_alive(self, observer: LockHolder) -> bool | None:
        """Whether the holder still runs, judged from its pid; None when ``observer`` cannot
        tell (see ``unverifiable``)."""
        if self.unverifiable(observer) is not None:
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


def _boot_id() -> str | None:
    """This boot of this machine's kernel (Linux); None where unknown."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return None


def _pid_namespace() -> str | None:
    """This process's PID namespace, as ``pid:[<inode>]`` (Linux); None where unknown."""
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return None


def _process_start(pid: int) -> int | None:
    """When ``pid`` started, in clock ticks since boot (Linux); None where unknown."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # The command name (field 2) may hold spaces and parentheses: count from its end.
    return int(stat.rsplit(")", 1)[1].split()[19])
