"""Finding a straggler: each rank's time blocked at gradient synchronisation, and the spread of
the ranks' busy times over a logging window."""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.autograd import Variable
from torch.utils._pytree import tree_leaves
from torch.utils.hooks import RemovableHandle


class BackwardWaits:
    """Host seconds that backward passes spend in their final callbacks, summed until taken.

    Data parallelism waits for the slowest rank there: DDP's final callback waits for the
    gradient all-reduce, FSDP2's for the reduce-scatter. A backward hook on the outputs of
    each attached model queues a callback at the start of the pass; the engine runs final
    callbacks in order, so it runs once the local gradients are computed and before those
    waits, and the callback it queues in turn runs after them. A pass through no attached
    model's output, or one under ``no_grad``, is not timed.
    """

    def __init__(self) -> None:
        self._handles: list[RemovableHandle] = []
        self._seconds = 0.0
        self._queued = False
        self._computed = 0.0

    def attach(self, models: Iterable[nn.Module]) -> None:
        """Time the backward passes through these models' outputs (replacing earlier ones)."""
        self.detach()
        for model in models:
            # First among the model's forward hooks: the backward hooks this one puts on the
            # outputs then run, and queue the first final callback, before FSDP2's own.
            self._handles.append(model.register_forward_hook(self._on_forward, prepend=True))

    def detach(self) -> None:
        """Remove the hooks; passes already under way are still timed."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def add(self, seconds: float) -> None:
        """Count ``seconds`` spent waiting elsewhere (an exchange between ranks)."""
        self._seconds += seconds

    def take(self) -> float:
        """The seconds counted since the last ``take()``; call it between backward passes."""
        seconds, self._seconds = self._seconds, 0.0
        self._queued = False  # a pass that raised never ran its callbacks
        return seconds

    def _on_forward(self, module: nn.Module, args: Any, output: Any) -> None:
        if not torch.is_grad_enabled():
            return
        for leaf in tree_leaves(output):
            if isinstance(leaf, torch.Tensor) and leaf.requires_grad:
                leaf.register_hook(self._on_backward)

    def _on_backward(self, grad: torch.Tensor) -> None:
        if not self._queued:
            self._queued = True
            Variable._execution_engine.queue_callback(self._on_computed)  # type: ignore[attr-defined]

    def _on_computed(self) -> None:
        self._computed = time.perf_counter()
        # Callbacks queued by a callback run after every callback queued before it.
        Variable._execution_engine.queue_callback(self._on_synchronized)  # type: ignore[attr-defined]

    def _on_synchronized(self) -> None:
        self._seconds += time.perf_counter() - self._computed
        self._queued = False


@dataclass(frozen=True)
class RankSpread:
    """Every rank's mean busy seconds per optimizer step over one window, by rank."""

    busy: tuple[float, ...]

    @property
    def slowest(self) -> int:
        """The rank with the most busy time (the lowest such rank on a tie)."""
        return max(range(len(self.busy)), key=lambda rank: (self.busy[rank], -rank))

    @property
    def median(self) -> float:
        return statistics.median(self.busy)

    @property
    def excess(self) -> float:
        """How much the slowest rank's busy time exceeds the median, as a fraction (0.5 is
        50 % more); 0 when the median is 0 (a clock too coarse to see the steps)."""
        median = self.median
        return max(self.busy) / median - 1 if median > 0 else 0.0

    def metrics(self) -> dict[str, float]:
        return {"throughput/busy_time_min": min(self.busy),
                "throughput/busy_time_median": self.median,
                "throughput/busy_time_max": max(self.busy),
                "throughput/slowest_rank": float(self.slowest)}


class StragglerStreak:
    """Consecutive windows in which the same rank was the slowest by more than ``threshold``
    over the median.

    Args:
        threshold: The excess over the median that counts, as a fraction.
        windows: Every this many consecutive windows, ``update`` says to warn.
    """

    def __init__(self, threshold: float, windows: int) -> None:
        self.threshold = threshold
        self.windows = windows
        self.rank: int | None = None
        self.length = 0

    def update(self, spread: RankSpread) -> bool:
        """Count one window; True when the streak reached a multiple of ``windows``."""
        excess = spread.excess
        if not (math.isfinite(excess) and excess > self.threshold):
            self.rank, self.length = None, 0
            return False
        if spread.slowest == self.rank:
            self.length += 1
        else:
            self.rank, self.length = spread.slowest, 1
        return self.length % self.windows == 0
