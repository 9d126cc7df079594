"""``Throughput``: step time, samples/s, tokens/s, MFU and memory over a window of steps, and
the spread of the ranks' busy time that finds a straggler."""

from __future__ import annotations

import logging
import math
import time
from collections import deque
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from typing_extensions import override

from dream_trainer.mixins.logging import LoggerMixin
from dream_trainer.trainer.base import BaseTrainer
from dream_trainer.trainer.callback import Callback
from dream_trainer.utils.memory import GIB, CudaPeakWindow, process_rss_bytes
from dream_trainer.utils.stragglers import BackwardWaits, RankSpread, StragglerStreak

TOKEN_KEYS = ("tokens", "input_ids")
"""Batch keys whose tensor ``numel()`` counts as tokens when ``tokens_per_sample`` is None."""

logger = logging.getLogger(__name__)


class Throughput(Callback[BaseTrainer]):
    """Time each optimizer step; keep step time, samples/s, tokens/s, MFU, memory, and find
    a rank slower than the others (a straggler).

    Values are means over the last ``window`` steps, kept in ``latest`` under
    ``throughput/{step_time,samples_per_second,tokens_per_second,mfu}``, memory figures in
    ``memory``; every ``window`` steps the ranks' busy times are compared in ``spread`` and
    all three are passed to ``trainer.log_dict(values, step)`` on rank 0 when the trainer
    has one. Validation and the time between epochs are not counted. Samples are counted
    over every data-parallel rank; tokens from ``tokens_per_sample``, else from the
    ``numel()`` of a dict batch's ``"tokens"`` or ``"input_ids"`` tensor times ``dp_size``.
    MFU is ``flops_per_sample * samples_per_second / (peak_flops * world_size)``, when both
    are given. Memory, in GiB: ``memory/rss_gib``, the resident set size; on CUDA also
    ``memory/cuda_allocated_peak_gib`` and ``memory/cuda_reserved_peak_gib``, the allocator's
    peaks on the rank's device since the logging window began.

    It runs on every rank, each keeping its own figures (rank 0's are logged). A rank's busy
    time is its step time less the host time its backward passes spent blocked in
    gradient synchronisation waiting for the others: ranks in step take equally long, but
    the slowest one waits least. Every ``window`` steps the ranks exchange their mean busy
    time in one ``all_gather`` (none on one process): ``spread`` holds
    ``throughput/busy_time_{min,median,max}`` and ``throughput/slowest_rank``. When the same
    rank is busy more than ``straggler_threshold`` over the median for ``straggler_windows``
    windows in a row, rank 0 logs a warning naming it (again every ``straggler_windows``
    windows while it lasts).

    Args:
        flops_per_sample: Training FLOPs per sample (forward and backward, e.g. ``6 * n_params
            * tokens_per_sample`` for a transformer).
        peak_flops: Peak FLOP/s of one device at the training precision.
        window: Optimizer steps averaged over, and the logging interval.
        tokens_per_sample: Tokens in one sample, when fixed; overrides counting batch keys.
        straggler_threshold: How much busier than the median rank a straggler is, as a
            fraction (0.2: 20 % more).
        straggler_windows: Consecutive logging windows a rank must be a straggler before the
            warning.

    Raises:
        ValueError: if ``window < 1``, ``straggler_windows < 1``, or a given number is not
            positive.
    """

    def __init__(self, flops_per_sample: float | None = None, peak_flops: float | None = None,
                 window: int = 20, tokens_per_sample: int | None = None,
                 straggler_threshold: float = 0.2, straggler_windows: int = 3) -> None:
        if window < 1:
            raise ValueError(f"Throughput window must be at least 1 optimizer step, got {window}")
        for name, value in (("flops_per_sample", flops_per_sample), ("peak_flops", peak_flops),
                            ("tokens_per_sample", tokens_per_sample)):
            if value is not None and not value > 0:
                raise ValueError(f"Throughput {name} must be positive (or None), got {value}")
        if not (math.isfinite(straggler_threshold) and straggler_threshold > 0):
            raise ValueError(
                f"Throughput straggler_threshold must be a positive fraction of the median "
                f"rank's busy time (0.2 flags a rank 20 % busier), got {straggler_threshold}")
        if isinstance(straggler_windows, bool) or not isinstance(straggler_windows, int) \
                or straggler_windows < 1:
            raise ValueError(f"Throughput straggler_windows must be an int of at least 1 "
                             f"logging window, got {straggler_windows!r}")
        self.flops_per_sample = flops_per_sample
        self.peak_flops = peak_flops
        self.window = window
        self.tokens_per_sample = tokens_per_sample
        self.straggler_threshold = straggler_threshold
        self.straggler_windows = straggler_windows
        self.latest: dict[str, float] = {}
        self.memory: dict[str, float] = {}
        self.spread: dict[str, float] = {}
        self._step_times: deque[float] = deque(maxlen=window)
        self._busy_times: deque[float] = deque(maxlen=window)
        self._step_tokens: deque[int] = deque(maxlen=window)
        self._window_tokens = 0
        self._last_time = 0.0
        self._cuda_peaks: CudaPeakWindow | None = None
        self._waits = BackwardWaits()
        self._streak = StragglerStreak(straggler_threshold, straggler_windows)
        self._logger: LoggerMixin | None = None

    @property
    def step_times(self) -> list[float]:
        """Seconds taken by each of the last ``window`` optimizer steps, oldest first."""
        return list(self._step_times)

    # -- hooks ---------------------------------------------------------------------------------
    @override
    def attached(self) -> None:
        trainer = self.trainer
        # Rank 0's figures are the ones logged; every rank measures.
        logs = isinstance(trainer, LoggerMixin) and trainer.world.is_rank_zero
        self._logger = trainer if logs else None

    @override
    def pre_fit(self) -> None:
        device = self.trainer.world.device
        self._cuda_peaks = CudaPeakWindow(device) if device.type == "cuda" else None
        self._waits.attach(self.trainer.named_models().values())

    @override
    def pre_train_epoch(self) -> None:
        self._window_tokens = 0
        self._restart_clock()

    @override
    def pre_train_batch(self, batch: Any, batch_idx: int) -> None:
        if self.tokens_per_sample is None:
            self._window_tokens += _count_tokens(batch)

    @override
    def post_train_batch(self, result: dict[str, Any], batch_idx: int) -> None:
        if self.trainer.is_accumulating_gradients:
            return
        now = time.perf_counter()
        seconds = now - self._last_time
        self._step_times.append(seconds)
        self._busy_times.append(max(seconds - self._waits.take(), 0.0))
        self._step_tokens.append(self._window_tokens * self.trainer.world.dp_size)
        self._window_tokens = 0
        self._last_time = now
        self.latest = self._measure()
        # The same step on every rank: each reaches the exchange, so none waits forever.
        window_ends = self.trainer.global_step % self.window == 0
        if window_ends:
            self.spread = self._compare_ranks()
        self.memory = self._memory(window_ends)
        if window_ends and self._logger is not None:
            self._logger.log_dict({**self.latest, **self.memory, **self.spread},
                                  self.trainer.global_step)

    @override
    def post_val_epoch(self, result: dict[str, Any]) -> None:
        self._restart_clock()

    @override
    def teardown(self) -> None:
        self._waits.detach()

    def _restart_clock(self) -> None:
        self._last_time = time.perf_counter()
        self._waits.take()

    # -- measuring -----------------------------------------------------------------------------
    def _measure(self) -> dict[str, float]:
        world = self.trainer.world
        samples_per_step = self.trainer.global_batch_size
        seconds = sum(self._step_times)
        steps = len(self._step_times)
        samples_per_second = _rate(samples_per_step * steps, seconds)
        values = {"throughput/step_time": seconds / steps,
                  "throughput/samples_per_second": samples_per_second}
        if self.tokens_per_sample is not None:
            values["throughput/tokens_per_second"] = samples_per_second * self.tokens_per_sample
        elif any(self._step_tokens):
            values["throughput/tokens_per_second"] = _rate(sum(self._step_tokens), seconds)
        if self.flops_per_sample is not None and self.peak_flops is not None:
            values["throughput/mfu"] = (self.flops_per_sample * samples_per_second
                                        / (self.peak_flops * world.world_size))
        return values

    def _compare_ranks(self) -> dict[str, float]:
        """Every rank's mean busy time over the window, exchanged in one ``all_gather``; warn
        on rank 0 about a persistent straggler."""
        world = self.trainer.world
        mine = sum(self._busy_times) / len(self._busy_times)
        busy = [mine]
        if world.world_size > 1:
            started = time.perf_counter()
            local = torch.tensor([mine], dtype=torch.float64, device=world.device)
            gathered = [torch.empty_like(local) for _ in range(world.world_size)]
            dist.all_gather(gathered, local)
            busy = torch.cat(gathered).tolist()
            # The exchange waits for the slowest rank: not this rank's own work.
            self._waits.add(time.perf_counter() - started)
        spread = RankSpread(tuple(busy))
        if self._streak.update(spread) and world.is_rank_zero:
            logger.warning(
                "rank %d is a straggler: busy %.1f ms per optimizer step, %.0f%% more than the "
                "median rank's %.1f ms, for %d logging windows in a row (to step %d; "
                "straggler_threshold=%g)", spread.slowest, 1e3 * busy[spread.slowest],
                100 * spread.excess, 1e3 * spread.median, self._streak.length,
                self.trainer.global_step, self.straggler_threshold)
        return spread.metrics()

    def _memory(self, window_ends: bool) -> dict[str, float]:
        values = {}
        rss = process_rss_bytes()
        if rss is not None:
            values["memory/rss_gib"] = rss / GIB
        if self._cuda_peaks is not None:
            allocated, reserved = (self._cuda_peaks.read() if window_ends
                                   else self._cuda_peaks.peek())
            values["memory/cuda_allocated_peak_gib"] = allocated / GIB
            values["memory/cuda_reserved_peak_gib"] = reserved / GIB
        return values


def _rate(amount: float, seconds: float) -> float:
    # A clock too coarse to see the steps leaves the rate unknown (NaN), not infinite.
    return amount / seconds if seconds > 0 else float("nan")


def _count_tokens(batch: Any) -> int:
    """``numel()`` of the first ``TOKEN_KEYS`` tensor of a dict batch; 0 for other batches."""
    if isinstance(batch, Mapping):
        for key in TOKEN_KEYS:
            value = batch.get(key)
            if isinstance(value, torch.Tensor):
                return value.numel()
    return 0
