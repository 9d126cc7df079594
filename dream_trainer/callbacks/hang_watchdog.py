"""``HangWatchdog``: end a process whose training made no progress for too long, with its stacks."""

from __future__ import annotations

import faulthandler
import math
import os
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, NoReturn

import torch.distributed as dist
from typing_extensions import override

from dream_trainer.trainer.callback import Callback


class HangWatchdog(Callback):
    """Dump every thread's stack and exit with code 1 when no batch finished for ``timeout`` s.

    A daemon thread, started in ``pre_fit``, watches for progress: the end of a training or
    validation batch. It arms at the first ``pre_train_epoch``, so that setup and the sanity
    check are not timed, and stops when ``fit()`` ends or fails. A hung rank then leaves its
    stacks in its own log instead of waiting for the collective timeout, and its peers, blocked
    in a collective with it, are ended by their own watchdogs. Before exiting, each also dumps
    its flight recorder, the last collectives of every process group with their state
    (NCCL's on CUDA, else gloo's, which torch 2.13 records too), to
    ``<trace_dir>/flight_recorder_<rank>``;
    ``python -m torch.distributed.flight_recorder.fr_trace <trace_dir> -p flight_recorder_``
    then shows which collective the ranks disagree on. ``DeviceParameters
    .flight_recorder_entries`` sizes (or turns off) the recorder.

    Args:
        timeout: Seconds without a finished batch before the process is ended. Allow for the
            slowest legitimate gap: a checkpoint save, a validation pass's first batch.
        trace_dir: Where the flight recorder dumps go; the system's temporary directory when
            None.

    Raises:
        ValueError: if ``timeout`` is not a positive, finite number of seconds.
    """

    def __init__(self, timeout: float, trace_dir: str | Path | None = None) -> None:
        if not (timeout > 0 and math.isfinite(timeout)):
            raise ValueError(f"HangWatchdog timeout must be a positive number of seconds, "
                             f"got {timeout}")
        self.timeout = float(timeout)
        self.trace_dir = Path(trace_dir if trace_dir is not None else tempfile.gettempdir())
        # time.monotonic() of the last progress; None while disarmed. Plain attribute reads and
        # writes are atomic under the GIL, so the watcher thread needs no lock.
        self._last_progress: float | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def watching(self) -> bool:
        """Whether the watchdog thread is running."""
        return self._thread is not None and self._thread.is_alive()

    # -- hooks ---------------------------------------------------------------------------------
    @override
    def pre_fit(self) -> None:
        self._halt()
        # A fresh event per thread: a thread left over from an earlier fit() cannot revive.
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, args=(self._stop,),
                                        name="dream_trainer-hang-watchdog", daemon=True)
        self._thread.start()

    @override
    def pre_train_epoch(self) -> None:
        self._last_progress = time.monotonic()

    @override
    def post_train_batch(self, result: dict[str, Any], batch_idx: int) -> None:
        self._last_progress = time.monotonic()

    @override
    def post_val_batch(self, result: dict[str, Any], batch_idx: int) -> None:
        self._last_progress = time.monotonic()

    @override
    def teardown(self) -> None:
        self._halt()

    # -- the watcher thread --------------------------------------------------------------------
    def _halt(self) -> None:
        self._last_progress = None
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def _watch(self, stop: threading.Event) -> None:
        poll = min(1.0, self.timeout / 4)
        while not stop.wait(poll):
            last = self._last_progress
            if last is None:
                continue
            stuck = time.monotonic() - last
            if stuck > self.timeout:
                self._abort(stuck)

    def _abort(self, stuck: float) -> NoReturn:
        """Report the hang on stderr and end the process with exit code 1."""
        # os._exit, not an exception: the main thread may be blocked inside a C collective
        # where no Python exception can reach it. The finally makes sure a failed report
        # cannot leave the process running.
        try:
            trainer = self.trainer
            print(f"HangWatchdog: rank {trainer.world.rank} of {trainer.world.world_size} made "
                  f"no progress for {stuck:.1f} s (timeout {self.timeout:g} s) at global step "
                  f"{trainer.global_step}, epoch {trainer.current_epoch}; stacks of every "
                  "thread follow, then the process exits with code 1",
                  file=sys.stderr, flush=True)
            faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
            sys.stderr.flush()
            self._dump_flight_recorder(trainer.world.rank)
        finally:
            os._exit(1)

    def _dump_flight_recorder(self, rank: int) -> None:
        """Write the flight recorder's pickled entries, if a process group records them."""
        if not (dist.is_available() and dist.is_initialized()):
            return
        import torch._C._distributed_c10d as c10d

        # NCCL keeps its own recorder (CUDA builds only); gloo's is the generic one.
        cuda = self.trainer.world.device.type == "cuda"
        dump = (getattr(c10d, "_dump_nccl_trace", None) if cuda else None) \
            or getattr(c10d, "_dump_fr_trace", None)
        if dump is None:
            print("HangWatchdog: this torch has no flight recorder to dump", file=sys.stderr,
                  flush=True)
            return
        path = self.trace_dir / f"flight_recorder_{rank}"
        data = dump()
        self.trace_dir.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        print(f"HangWatchdog: flight recorder of rank {rank} written to {path}",
              file=sys.stderr, flush=True)
