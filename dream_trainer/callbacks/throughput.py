"""``Throughput``: step time, samples/s, tokens/s, MFU and memory over a window of steps."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch
from typing_extensions import override

from dream_trainer.mixins.logging import LoggerMixin
from dream_trainer.trainer.callback import RankZeroCallback
from dream_trainer.utils.memory import GIB, CudaPeakWindow, process_rss_bytes

if TYPE_CHECKING:
    from dream_trainer.trainer.base import BaseTrainer

TOKEN_KEYS = ("tokens", "input_ids")
"""Batch keys whose tensor ``numel()`` counts as tokens when ``tokens_per_sample`` is None."""


class Throughput(RankZeroCallback):
    """Time each optimizer step on rank 0; keep step time, samples/s, tokens/s, MFU, memory.

    Values are means over the last ``window`` steps, kept in ``latest`` under
    ``throughput/{step_time,samples_per_second,tokens_per_second,mfu}``, memory figures in
    ``memory``; every ``window`` steps both are passed to ``trainer.log_dict(values, step)``
    when the trainer has one. Validation and the time between epochs are not counted. Samples are counted over every data-parallel
    rank; tokens from ``tokens_per_sample``, else from the ``numel()`` of a dict batch's
    ``"tokens"`` or ``"input_ids"`` tensor times ``dp_size``. MFU is ``flops_per_sample *
    samples_per_second / (peak_flops * world_size)``, when both are given. Memory, in GiB:
    ``memory/rss_gib``, rank 0's resident set size; on CUDA also
    ``memory/cuda_allocated_peak_gib`` and ``memory/cuda_reserved_peak_gib``, the allocator's
    peaks on rank 0's device since the logging window began.

    Args:
        flops_per_sample: Training FLOPs per sample (forward and backward, e.g. ``6 * n_params
            * tokens_per_sample`` for a transformer).
        peak_flops: Peak FLOP/s of one device at the training precision.
        window: Optimizer steps averaged over.
        tokens_per_sample: Tokens in one sample, when fixed; overrides counting batch keys.

    Raises:
        ValueError: if ``window < 1`` or a given number is not positive.
    """

    trainer: BaseTrainer

    def __init__(self, flops_per_sample: float | None = None, peak_flops: float | None = None,
                 window: int = 20, tokens_per_sample: int | None = None) -> None:
        if window < 1:
            raise ValueError(f"Throughput window must be at least 1 optimizer step, got {window}")
        for name, value in (("flops_per_sample", flops_per_sample), ("peak_flops", peak_flops),
                            ("tokens_per_sample", tokens_per_sample)):
            if value is not None and not value > 0:
                raise ValueError(f"Throughput {name} must be positive (or None), got {value}")
        self.flops_per_sample = flops_per_sample
        self.peak_flops = peak_flops
        self.window = window
        self.tokens_per_sample = tokens_per_sample
        self.latest: dict[str, float] = {}
        self.memory: dict[str, float] = {}
        self._step_times: deque[float] = deque(maxlen=window)
        self._step_tokens: deque[int] = deque(maxlen=window)
        self._window_tokens = 0
        self._last_time = 0.0
        self._cuda_peaks: CudaPeakWindow | None = None

    @property
    def step_times(self) -> list[float]:
        """Seconds taken by each of the last ``window`` optimizer steps, oldest first."""
        return list(self._step_times)

    # -- hooks ---------------------------------------------------------------------------------
    @override
    def pre_fit(self) -> None:
        device = self.trainer.world.device
        self._cuda_peaks = CudaPeakWindow(device) if device.type == "cuda" else None

    @override
    def pre_train_epoch(self) -> None:
        self._window_tokens = 0
        self._last_time = time.perf_counter()

    @override
    def pre_train_batch(self, batch: Any, batch_idx: int) -> None:
        if self.tokens_per_sample is None:
            self._window_tokens += _count_tokens(batch)

    @override
    def post_train_batch(self, result: dict[str, Any], batch_idx: int) -> None:
        if self.trainer.is_accumulating_gradients:
            return
        now = time.perf_counter()
        self._step_times.append(now - self._last_time)
        self._step_tokens.append(self._window_tokens * self.trainer.world.dp_size)
        self._window_tokens = 0
        self._last_time = now
        self.latest = self._measure()
        window_ends = self.trainer.global_step % self.window == 0
        self.memory = self._memory(window_ends)
        if window_ends and isinstance(self.trainer, LoggerMixin):
            self.trainer.log_dict({**self.latest, **self.memory}, self.trainer.global_step)

    @override
    def post_val_epoch(self, result: dict[str, Any]) -> None:
        self._last_time = time.perf_counter()

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
