"""Ending a worker whose launcher is gone.

torchrun starts each worker in a session of its own, so a SIGKILL to torchrun (or to its
process group: ``timeout -s KILL``, ``kill -9``, an OOM killer) never reaches the workers.
Left alone they would train on with nobody to stop or restart them, write checkpoints next
to the rerun that follows, and hold the experiment's run lock. ``LauncherWatch`` ends such a
worker within about ``POLL_SECONDS``.
"""

from __future__ import annotations

import os
import threading

POLL_SECONDS = 0.5
"""How often the watch compares this process's parent with the launcher: the bound on how
long a worker outlives its launcher, besides the time the interpreter takes to schedule the
watch's thread."""

EXIT_CODE = 1
"""The exit status of a worker ended because its launcher is gone."""


class LauncherWatch:
    """A daemon thread that ends this process, at once and without saving, when its parent
    is no longer the launcher that started it (torchrun's agent; the OS hands an orphan to
    another parent).

    Ending at once is safe for checkpoints: one counts only once its ``dream_trainer.json``
    is written, last, after every rank's data (``checkpoint.directory.is_complete``), so a save
    cut short is never loaded and the newest complete checkpoint stays the one a rerun
    resumes from. It is not done with ``prctl(PR_SET_PDEATHSIG)``: that signal fires when
    the parent *thread* that started the process ends (not only the parent process), says
    nothing about why the worker stops, and exists only on Linux.

    Args:
        launcher_pid: The process id of the launcher, this process's parent at start.
        rank: This process's global rank, for the message.
        poll_seconds: How often the parent is checked.
    """

    def __init__(self, launcher_pid: int, rank: int, poll_seconds: float = POLL_SECONDS) -> None:
        self.launcher_pid = launcher_pid
        self.rank = rank
        self.poll_seconds = poll_seconds
        self._stopped = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self) -> None:
        """Start watching (a second call while it watches does nothing)."""
        if self.running:
            return
        self._stopped.clear()
        self._thread = threading.Thread(target=self._watch, name="dream_trainer-launcher-watch",
                                        daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop watching and wait for the thread to finish (at most one poll)."""
        self._stopped.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def _watch(self) -> None:
        # Event.wait sleeps with the interpreter lock released: the training thread never
        # waits for this one, which costs one getppid() call per poll.
        while not self._stopped.wait(self.poll_seconds):
            if os.getppid() != self.launcher_pid:
                self._end()

    def _end(self) -> None:
        """Say why on stderr, then end the process without unwinding anything: the main
        thread may be inside a collective whose peers are gone, or in the middle of a save
        that must not complete now."""
        message = (f"dream_trainer: rank {self.rank} stops now, without saving: its launcher "
                   f"(pid {self.launcher_pid}, torchrun) is gone, so nothing would stop or "
                   "restart this worker. Rerun the command with resume='latest' to continue "
                   "from the newest complete checkpoint.\n")
        # os.write, not print: sys.stderr's lock may be held by the thread this one ends.
        os.write(2, message.encode())
        os._exit(EXIT_CODE)
