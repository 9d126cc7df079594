"""``Profiler``: a ``torch.profiler`` trace of a few optimizer steps, written per rank."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from torch.profiler import ProfilerActivity, profile, schedule
from typing_extensions import override

from dream_trainer.trainer.abstract import AbstractTrainer
from dream_trainer.trainer.callback import Callback


class Profiler(Callback[AbstractTrainer]):
    """Profile ``num_steps`` optimizer steps after the first ``start_step`` on every rank.

    Optimizer step ``start_step`` warms the profiler up and is discarded; steps
    ``start_step + 1`` to ``start_step + num_steps`` are recorded (CPU, and CUDA when training
    on a GPU), each marked ``ProfilerStep#N`` in the trace. When the window closes each rank
    writes ``output_dir/trace_rank<r>.json`` (a Chrome trace for ``chrome://tracing`` or
    Perfetto) and ``output_dir/summary_rank<r>.txt`` (the top 20 operators by self CPU time).
    A window cut short by the end of training or an exception is written with the steps it
    recorded. A resumed run past ``start_step`` profiles its first steps.

    Args:
        start_step: Optimizer steps to let pass first (compilation, allocator warm-up); the
            last of them warms the profiler up.
        num_steps: Optimizer steps recorded.
        output_dir: Directory for the files, created if missing.

    Raises:
        ValueError: if ``start_step < 1`` or ``num_steps < 1``.
    """

    def __init__(self, start_step: int = 2, num_steps: int = 3,
                 output_dir: str | Path = "profile") -> None:
        if start_step < 1:
            raise ValueError(f"Profiler start_step must be at least 1, got {start_step}: the "
                             "step before the recorded ones warms the profiler up")
        if num_steps < 1:
            raise ValueError(f"Profiler num_steps must be at least 1, got {num_steps}")
        self.start_step = start_step
        self.num_steps = num_steps
        self.output_dir = Path(output_dir)
        self.trace_path: Path | None = None
        self.summary_path: Path | None = None
        self._profile: profile | None = None
        self._done = False

    # -- hooks ---------------------------------------------------------------------------------
    @override
    def pre_train_epoch(self) -> None:
        self._maybe_start()

    @override
    def post_train_batch(self, result: dict[str, Any], batch_idx: int) -> None:
        if self.trainer.is_accumulating_gradients:
            return
        if self._profile is not None:
            # The schedule ends the window by itself, calling _write, after the last step.
            self._profile.step()
            if self._done:
                self._stop()
        self._maybe_start()

    @override
    def teardown(self) -> None:
        self._stop()

    # -- profiling -----------------------------------------------------------------------------
    def _maybe_start(self) -> None:
        if self._done or self._profile is not None:
            return
        if self.trainer.global_step < self.start_step - 1:
            return
        activities = [ProfilerActivity.CPU]
        if self.trainer.world.device.type == "cuda":
            activities.append(ProfilerActivity.CUDA)
        self._profile = profile(
            activities=activities,
            schedule=schedule(wait=0, warmup=1, active=self.num_steps, repeat=1),
            on_trace_ready=self._write,
        )
        self._profile.start()

    def _stop(self) -> None:
        """Stop profiling; a window still recording is written (by the schedule) first."""
        if self._profile is not None:
            self._profile.stop()
            self._profile = None
            self._done = True

    def _write(self, prof: profile) -> None:
        rank = self.trainer.world.rank
        self.output_dir.mkdir(parents=True, exist_ok=True)
        self.trace_path = self.output_dir / f"trace_rank{rank}.json"
        self.summary_path = self.output_dir / f"summary_rank{rank}.txt"
        prof.export_chrome_trace(str(self.trace_path))
        table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=20)
        self.summary_path.write_text(table + "\n")
        self._done = True
