"""Turning SIGTERM/SIGUSR1 into a flag the training loop checks at step boundaries."""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections.abc import Callable
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
    """Every rank learns whether any rank's ``PreemptionFlag`` is set, at the same step.

    ``poll()`` runs at every step boundary. Alone it reads the flag. With several ranks, at
    the boundaries where the ranks poll, it reads the all-reduce it started at the previous
    poll (long finished by then) and starts the next one, so the loop never waits on the
    network. The ranks poll about every ``seconds`` of training: each proposes, in its vote,
    how many steps that is at its own step time since the last poll (at least 1, at most
    ``max_interval``), and all take the smallest, so they stay in step. A signal is acted on
    within two intervals; with ``seconds=0``, one step after it. Per step, the all-reduce
    cost 2 CPU ranks of a small model a quarter of their step time. The reduction runs on a
    CPU gloo group of its own: it never synchronizes an accelerator stream, and it cannot
    interleave with the collectives of a checkpoint being written in the background.
    """

    def __init__(self, flag: PreemptionFlag, group: Any = None, seconds: float = 0.0,
                 max_interval: int = 100,
                 clock: Callable[[], float] = time.monotonic) -> None:
        """
        Args:
            flag: This rank's flag.
            group: A gloo process group spanning every rank; ``None`` for one process.
            seconds: About how much training time passes between polls (0: every step).
            max_interval: The most steps between polls, however fast the steps.
            clock: Where time is read (tests pass their own).
        """
        self.flag = flag
        self.group = group
        self.seconds = seconds
        self.max_interval = max_interval
        self._clock = clock
        self._work: Any = None
        self._vote = torch.zeros(2, dtype=torch.int32)
        self._countdown = 1  # steps until the next poll
        self._steps = 0  # steps since the last poll
        self._last_poll = clock()
        self.polls = 0
        """How many times the ranks have voted (a measure of the collectives spent)."""

    def poll(self) -> bool:
        """True on every rank, at the same step, once any rank's flag was set before the
        previous poll."""
        if self.group is None:
            return self.flag.is_set
        self._steps += 1
        self._countdown -= 1
        if self._countdown > 0:
            return False
        agreed, interval = False, 1
        if self._work is not None:
            self._work.wait()
            flag, negated = self._vote.tolist()  # a CPU tensor: no device synchronization
            agreed, interval = bool(flag), max(1, -negated)
        if agreed:
            self._work = None
            return True
        # gloo cannot all-reduce bool, so int32; MAX of [flag, -proposal] agrees on both.
        self._vote = torch.tensor([int(self.flag.is_set), -self._proposal()], dtype=torch.int32)
        self._work = dist.all_reduce(self._vote, op=dist.ReduceOp.MAX, group=self.group,
                                     async_op=True)
        self.polls += 1
        self._countdown = interval
        return False

    def _proposal(self) -> int:
        """The steps that fit in ``seconds`` at this rank's step time since the last poll."""
        now = self._clock()
        step_time, self._last_poll = (now - self._last_poll) / self._steps, now
        self._steps = 0
        if self.seconds <= 0 or step_time <= 0:
            return 1
        return max(1, min(self.max_interval, int(self.seconds / step_time)))

    def finish(self) -> None:
        """Complete the reduction in flight, so the group can be destroyed (all ranks call
        it at the same point, e.g. the end of ``fit()``)."""
        if self._work is not None:
            self._work.wait()
            self._work = None
