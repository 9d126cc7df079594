"""``StepTimer``: the step timing the step-time benchmarks share."""

from __future__ import annotations

import statistics
import time
from typing import Any

WARMUP = 5
"""Steps left out of ``median_step``."""


class StepTimer:
    """For a trainer (listed before its trainer bases): ``times``, the seconds of each
    optimizer step of one micro-batch, from batch start to its end."""

    times: list[float]

    def pre_train_batch(self, batch: Any, batch_idx: int) -> None:
        super().pre_train_batch(batch, batch_idx)  # type: ignore[misc]
        self._start = time.perf_counter()

    def post_train_batch(self, result: dict[str, Any], batch_idx: int) -> None:
        # Stopped before the base hook, as it was started after it: neither is the step's.
        self.times.append(time.perf_counter() - self._start)
        super().post_train_batch(result, batch_idx)  # type: ignore[misc]

    def median_step(self) -> float:
        """The median step time after the warm-up steps."""
        return statistics.median(self.times[WARMUP:])
