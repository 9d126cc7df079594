"""Turning SIGTERM/SIGUSR1 into a flag the training loop checks at step boundaries."""

from __future__ import annotations

import logging
import signal
import threading
from types import FrameType
from typing import Any

logger = logging.getLogger(__name__)

SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class PreemptionFlag:
    """Records that the scheduler asked this process to stop.

    The handler only sets a flag: collectives and file writes are unsafe inside a signal
    handler, so the trainer acts on the flag at the next step boundary, after every rank
    agreed on it.
    """

    def __init__(self) -> None:
        self.signal: signal.Signals | None = None
        self._previous: dict[signal.Signals, Any] = {}

    def install(self) -> None:
        """Install the handlers (only possible from the main thread; elsewhere a no-op)."""
        if threading.current_thread() is not threading.main_thread():
            return
        for sig in SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)

    def uninstall(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self.signal = signal.Signals(signum)
        logger.warning("received %s: a checkpoint will be saved at the next step boundary",
                       self.signal.name)

    @property
    def is_set(self) -> bool:
        return self.signal is not None
