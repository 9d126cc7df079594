"""Turning SIGTERM/SIGUSR1 into a flag the training loop checks at step boundaries."""

from __future__ import annotations

import logging
import signal
import threading
from types import FrameType
from typing import Any

import torch
import torch.distributed as dist

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


class PreemptionAgreement:
    """Every rank learns whether any rank's ``PreemptionFlag`` is set, one step late.

    ``poll()`` runs at every step boundary. With several ranks it reads the result of the
    all-reduce it started at the previous boundary (long finished by then) and starts the
    next one, so the loop never waits on the network. The reduction runs on a CPU gloo group
    of its own: it never synchronizes an accelerator stream, and it cannot interleave with
    the collectives of a checkpoint being written in the background. All ranks read the same
    reduction at the same step, so they stop together.
    """

    def __init__(self, flag: PreemptionFlag, group: Any = None) -> None:
        """
        Args:
            flag: This rank's flag.
            group: A gloo process group spanning every rank; ``None`` for one process.
        """
        self.flag = flag
        self.group = group
        self._work: Any = None
        self._vote = torch.zeros(1, dtype=torch.int32)

    def poll(self) -> bool:
        """True on every rank once any rank's flag was set by the previous boundary."""
        if self.group is None:
            return self.flag.is_set
        agreed = False
        if self._work is not None:
            self._work.wait()
            agreed = bool(self._vote.item())  # a CPU tensor: no device synchronization
        if not agreed:
            # gloo cannot all-reduce bool, so int32.
            self._vote = torch.tensor([int(self.flag.is_set)], dtype=torch.int32)
            self._work = dist.all_reduce(self._vote, op=dist.ReduceOp.MAX, group=self.group,
                                         async_op=True)
        else:
            self._work = None
        return agreed

    def finish(self) -> None:
        """Complete the reduction in flight, so the group can be destroyed (all ranks call
        it at the same point, e.g. the end of ``fit()``)."""
        if self._work is not None:
            self._work.wait()
            self._work = None
