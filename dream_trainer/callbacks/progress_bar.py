"""``ProgressBar``: training progress on a terminal, or plain lines in logs."""

from __future__ import annotations

import math
import sys
import time
from datetime import timedelta
from typing import TYPE_CHECKING, Any, TextIO

import torch
from typing_extensions import override

from dream_trainer.trainer.base import BaseTrainer
from dream_trainer.trainer.callback import RankZeroCallback
from dream_trainer.trainer.schedulers import planned_optimizer_steps
from dream_trainer.utils.memory import GIB, CudaPeakWindow, process_rss_bytes

if TYPE_CHECKING:
    from rich.progress import Progress, TaskID


class ProgressBar(RankZeroCallback[BaseTrainer]):
    """Show epoch, step, smoothed loss, throughput, ETA and memory, in optimizer steps.

    On a terminal (``stream.isatty()``) a rich display holds a bar for the current epoch and
    one for the whole run; elsewhere (CI logs, files) it prints one plain line per refresh,
    such as ``epoch 1/3 step 40/120 loss_ema 0.5234 2150.3 samples/s eta 0:00:12 rss 1.52 GiB``,
    and one per validation pass, such as ``validation epoch 1: val_loss=0.4321``. Memory is
    rank 0's: on CUDA ``mem A/R GiB``, the peaks allocated and reserved by the allocator since
    the last refresh; on the CPU ``rss R GiB``, the process's resident set size.

    Args:
        refresh_every_n_steps: Update the display every this many optimizer steps (and at
            the first and the last). ``None`` (the default) updates it once at least
            ``refresh_seconds`` have passed since the last update instead, so that a fast
            loop is not held up: each update reads the loss from the device, a host sync.
        refresh_seconds: With ``refresh_every_n_steps=None``, the least time between updates.
        smoothing: Weight of the newest optimizer step in the exponential moving averages of
            the loss and of the step time that throughput and ETA derive from; the loss shows
            as ``loss_ema``, or as ``loss`` with ``smoothing=1`` (the step's). The loss is
            the logged one (``BaseTrainer.reduce_step_result``: over the step's micro-batches
            and data-parallel ranks, item-weighted) on the steps a logger logs; without a
            logger, the mean of rank 0's ``result["loss"]`` over the step's micro-batches.
        stream: Where to write; ``sys.stdout`` (looked up when writing) by default.

    Raises:
        ValueError: if ``refresh_every_n_steps < 1``, ``refresh_seconds < 0`` or ``smoothing``
            is not in (0, 1].
    """

    def __init__(self, refresh_every_n_steps: int | None = None, smoothing: float = 0.1,
                 stream: TextIO | None = None, refresh_seconds: float = 1.0) -> None:
        if refresh_every_n_steps is not None and refresh_every_n_steps < 1:
            raise ValueError("ProgressBar refresh_every_n_steps must be at least 1 (or None "
                             f"to refresh by time), got {refresh_every_n_steps}")
        if refresh_seconds < 0:
            raise ValueError(f"ProgressBar refresh_seconds must be >= 0, got {refresh_seconds}")
        if not 0 < smoothing <= 1:
            raise ValueError(f"ProgressBar smoothing must be in (0, 1], got {smoothing}: it is "
                             "the weight of the newest step (1 means no smoothing)")
        self.refresh_every_n_steps = refresh_every_n_steps
        self.refresh_seconds = refresh_seconds
        self.smoothing = smoothing
        self._stream = stream
        self._progress: Progress | None = None
        self._epoch_task: TaskID
        self._run_task: TaskID
        self._total_steps = 0
        self._total_epochs = 0
        self._steps_per_epoch = 0
        self._epoch_start_step = 0
        # Loss: the current window's micro-batch losses, then the EMA, kept on the device so
        # that only a refresh syncs with the host.
        self._window_loss: torch.Tensor | None = None
        self._window_batches = 0
        self._loss_ema: torch.Tensor | None = None
        # Step time: measured from the last refresh (time and step), validation excluded.
        self._mark_time: float | None = None
        self._mark_step = 0
        self._fit_start_step = 0
        self._val_start: float | None = None
        self._step_time_ema: float | None = None
        self._cuda_peaks: CudaPeakWindow | None = None

    @property
    def stream(self) -> TextIO:
        """The stream written to."""
        return self._stream if self._stream is not None else sys.stdout

    # -- hooks ---------------------------------------------------------------------------------
    @override
    def pre_fit(self) -> None:
        self._stop_live()  # a display left by a fit() that failed in a hook of ours
        params = self.trainer.training_parameters
        self._steps_per_epoch = self.trainer.train_steps_per_epoch
        self._total_steps = planned_optimizer_steps(params, self._steps_per_epoch)
        needed = math.ceil(self._total_steps / self._steps_per_epoch)
        self._total_epochs = needed if params.n_epochs is None else min(params.n_epochs, needed)
        self._loss_ema = self._step_time_ema = None
        self._mark_time, self._mark_step = time.perf_counter(), self.trainer.global_step
        self._fit_start_step = self.trainer.global_step
        device = self.trainer.world.device
        self._cuda_peaks = CudaPeakWindow(device) if device.type == "cuda" else None
        if self.stream.isatty():
            self._start_live()

    @override
    def pre_train_epoch(self) -> None:
        self._window_loss, self._window_batches = None, 0
        epoch = self.trainer.current_epoch
        # A resumed run may start mid-epoch: every earlier epoch ran steps_per_epoch steps.
        self._epoch_start_step = min(epoch * self._steps_per_epoch, self.trainer.global_step)
        if self._progress is not None:
            epoch_steps = min(self._steps_per_epoch,
                              self._total_steps - epoch * self._steps_per_epoch)
            self._progress.reset(self._epoch_task, total=epoch_steps,
                                 completed=self.trainer.global_step - self._epoch_start_step,
                                 description=f"epoch {epoch + 1}/{self._total_epochs}")

    @override
    def post_train_batch(self, result: dict[str, Any], batch_idx: int) -> None:
        reduced = self.trainer.reduced_step_result
        if reduced is None and "loss" in result:
            # Until a logger reduces a step, rank 0's own losses make the average; after, the
            # bar shows the logged values, and touches no loss in between (no tensor op).
            loss = torch.as_tensor(result["loss"]).detach().float()
            self._window_loss = loss if self._window_loss is None else self._window_loss + loss
            self._window_batches += 1
        if self.trainer.is_accumulating_gradients:
            return
        if reduced is not None:
            # A logger reduces the steps it logs: the bar follows those values, the whole
            # step's over micro-batches and ranks, and not rank 0's alone in between.
            if reduced[0] == self.trainer.global_step and "loss" in reduced[1]:
                self._smooth(torch.tensor(reduced[1]["loss"]))
        elif self._window_loss is not None:
            self._smooth(self._window_loss / self._window_batches)
        self._window_loss, self._window_batches = None, 0
        step = self.trainer.global_step
        if self._due(step):
            self._refresh(step)

    def _smooth(self, step_loss: torch.Tensor) -> None:
        # lerp refuses a CPU operand beside a GPU one: a logged value (a float, on the CPU)
        # joins an average the device's losses started there.
        if self._loss_ema is None:
            self._loss_ema = step_loss
        else:
            self._loss_ema = torch.lerp(self._loss_ema, step_loss.to(self._loss_ema.device),
                                        self.smoothing)

    @override
    def pre_val_epoch(self) -> None:
        self._val_start = time.perf_counter()

    @override
    def post_val_epoch(self, result: dict[str, Any]) -> None:
        if self._val_start is not None and self._mark_time is not None:
            # Throughput and ETA are about training: the pass's time is taken out.
            self._mark_time += time.perf_counter() - self._val_start
        self._val_start = None
        if self.trainer.sanity_checking:
            return
        where = f"validation epoch {self.trainer.current_epoch + 1}"
        if self.trainer.training_parameters.val_every_n_steps is not None:
            where += f" step {self.trainer.global_step}"
        values = " ".join(f"{key}={_format_value(value)}" for key, value in result.items())
        self._print(f"{where}: {values}")

    @override
    def teardown(self) -> None:
        self._stop_live()

    # -- measuring and rendering ------------------------------------------------------------------
    def _due(self, step: int) -> bool:
        if step == self._total_steps:
            return True
        if self.refresh_every_n_steps is not None:
            return step % self.refresh_every_n_steps == 0
        # By time, the first step shows at once; _mark_time is the last refresh (validation
        # excluded), and reading the clock is no sync.
        assert self._mark_time is not None, "pre_fit sets the time mark before any step"
        return (step == self._fit_start_step + 1
                or time.perf_counter() - self._mark_time >= self.refresh_seconds)

    def _refresh(self, step: int) -> None:
        status = self._status(step)
        if self._progress is None:
            self._print(f"epoch {self.trainer.current_epoch + 1}/{self._total_epochs} "
                        f"step {step}/{self._total_steps} {status}")
            return
        self._progress.update(self._epoch_task, completed=step - self._epoch_start_step)
        self._progress.update(self._run_task, completed=step, status=status, refresh=True)

    def _status(self, step: int) -> str:
        """``loss L S samples/s eta H:MM:SS`` and memory, updating the step-time average (a
        host sync)."""
        now = time.perf_counter()
        assert self._mark_time is not None, "pre_fit sets the time mark before any step"
        steps = step - self._mark_step
        if steps > 0:
            step_time = (now - self._mark_time) / steps
            # Weighting a refresh of k steps as k updates of the same value keeps the average
            # per optimizer step, whatever refresh_every_n_steps is.
            weight = 1 - (1 - self.smoothing) ** steps
            self._step_time_ema = (step_time if self._step_time_ema is None else
                                   self._step_time_ema + weight * (step_time - self._step_time_ema))
            self._mark_time, self._mark_step = now, step
        # Labelled for what it is: with smoothing the bar's loss is not the step's (the value
        # a logger writes), so it must not read as if it were.
        label = "loss" if self.smoothing == 1 else "loss_ema"
        parts = [] if self._loss_ema is None else [f"{label} {float(self._loss_ema):.4f}"]
        if self._step_time_ema is not None:
            throughput = (self.trainer.global_batch_size / self._step_time_ema
                          if self._step_time_ema > 0 else math.inf)
            eta = timedelta(seconds=round((self._total_steps - step) * self._step_time_ema))
            parts += [f"{throughput:.1f} samples/s", f"eta {eta}"]
        return " ".join(parts + self._memory())

    def _memory(self) -> list[str]:
        if self._cuda_peaks is not None:
            allocated, reserved = self._cuda_peaks.read()
            return [f"mem {allocated / GIB:.2f}/{reserved / GIB:.2f} GiB"]
        rss = process_rss_bytes()
        return [] if rss is None else [f"rss {rss / GIB:.2f} GiB"]

    def _print(self, line: str) -> None:
        if self._progress is not None:
            self._progress.console.print(line, markup=False, highlight=False)
        else:
            print(line, file=self.stream, flush=True)

    def _start_live(self) -> None:
        # Imported here: `import dream_trainer.callbacks` must not load rich's live display.
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

        # The display refreshes only when a step asks it to, never from a background thread,
        # so refresh_every_n_steps bounds the rendering and host-sync cost.
        self._progress = Progress(
            TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
            TextColumn("{task.fields[status]}"),
            console=Console(file=self.stream), auto_refresh=False,
        )
        self._epoch_task = self._progress.add_task("epoch", total=self._steps_per_epoch,
                                                   status="")
        self._run_task = self._progress.add_task("train", total=self._total_steps,
                                                 completed=self.trainer.global_step, status="")
        self._progress.start()

    def _stop_live(self) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None


def _format_value(value: Any) -> str:
    """Four decimals for floats (and one-element tensors), ``str`` for anything else."""
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = value.item()
    return f"{value:.4f}" if isinstance(value, float) else str(value)
