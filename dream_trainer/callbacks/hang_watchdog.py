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

from dream_trainer.callbacks.hang_report import (read_records, verdict, wait_for_records,
                                                 write_record)
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

    Each ended rank also writes ``<trace_dir>/hang_rank<R>.json`` (its step, the frames of its
    main thread, its process groups by mesh axis, its recorded collectives) and waits up to
    ``report_wait`` seconds for the others'; rank 0 then prints one verdict: the ranks behind,
    the first collective they never entered (sequence number and mesh axis) and the frame each
    is in (see ``hang_report``; ``dream-trainer diagnose DIR`` prints it afterwards).

    Args:
        timeout: Seconds without a finished batch before the process is ended. Allow for the
            slowest legitimate gap: a checkpoint save, a validation pass's first batch.
        trace_dir: Where the flight recorder dumps and the hang records go; the system's
            temporary directory when None.
        report_wait: Seconds each ended rank waits for the other ranks' records before it
            exits; rank 0 then prints the verdict from those it has.

    Raises:
        ValueError: if ``timeout`` is not a positive, finite number of seconds.
    """

    def __init__(self, timeout: float, trace_dir: str | Path | None = None,
                 report_wait: float = 10.0) -> None:
        if not (timeout > 0 and math.isfinite(timeout)):
            raise ValueError(f"HangWatchdog timeout must be a positive number of seconds, "
                             f"got {timeout}")
        if not (report_wait >= 0 and math.isfinite(report_wait)):
            raise ValueError(f"HangWatchdog report_wait must be a non-negative number of "
                             f"seconds, got {report_wait}")
        self.report_wait = float(report_wait)
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
            self._report(stuck)
        finally:
            os._exit(1)

    def _report(self, stuck: float) -> None:
        """Write this rank's record, wait for the other ranks' and, on rank 0, print the
        verdict. Every rank waits, so none exits (and has its launcher end the others) before
        all have written."""
        trainer = self.trainer
        world = trainer.world
        config = trainer.config
        run = f"{config.project}/{config.group}/{config.experiment}#{world.env.restart_count}"
        write_record(self.trace_dir, run, world.rank, world.world_size, trainer.global_step,
                     trainer.current_epoch, stuck, world.mesh)
        wait_for_records(self.trace_dir, run, world.world_size, self.report_wait)
        if world.rank == 0:
            print(verdict(read_records(self.trace_dir, run)), file=sys.stderr, flush=True)
            print(f"HangWatchdog: the records are in {self.trace_dir}; `dream-trainer diagnose "
                  f"{self.trace_dir}` prints this verdict again", file=sys.stderr, flush=True)

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
