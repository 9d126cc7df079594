"""``HangWatchdog``: end a process whose training made no progress for too long, with its stacks."""

from __future__ import annotations

import faulthandler
import math
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any, NoReturn

from typing_extensions import override

from dream_trainer.callbacks.hang_files import private_trace_dir, write_file
from dream_trainer.callbacks.hang_report import report_once, write_record
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
    ``report_wait`` seconds for the others'; one rank (the lowest with a record) then prints
    the verdict: the ranks behind, the first collective they never entered (sequence number
    and mesh axis) and the frame each is in. No ended rank exits before it is printed, so a
    launcher that ends the others once one exits cannot cut it off, whichever rank's watchdog
    fired first (see ``hang_report.report_once``; ``dream-trainer diagnose DIR`` prints it
    afterwards). Files are written to a fresh name and renamed into place, never through a
    symlink (``hang_files``).

    Args:
        timeout: Seconds without a finished batch before the process is ended. Allow for the
            slowest legitimate gap: a checkpoint save, a validation pass's first batch.
        trace_dir: Where the flight recorder dumps and the hang records go; when None, the
            run's directory in this user's private one,
            ``<temp>/dream_trainer-<uid>/<project>/<group>/<experiment>/hang``, resolved at
            ``pre_fit``.
        report_wait: Seconds each ended rank waits for the other ranks' records, and then
            for the verdict, before it exits.

    Raises:
        ValueError: if ``timeout`` is not a positive, finite number of seconds.
        PermissionError: at ``pre_fit``, if ``<temp>/dream_trainer-<uid>`` is not a private
            directory of this user (only when ``trace_dir`` is None).
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
        self._requested_dir = None if trace_dir is None else Path(trace_dir)
        self.trace_dir: Path | None = self._requested_dir
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
        # Resolved here, not at the hang: a directory another user planted fails the run now,
        # with the fix, instead of costing the report.
        config = self.trainer.config
        self.trace_dir = self._requested_dir or private_trace_dir(
            config.project, config.group, config.experiment)
        # A fresh event per thread: a thread left over from an earlier fit() cannot revive.
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, args=(self._stop, self.trace_dir),
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

    def _watch(self, stop: threading.Event, directory: Path) -> None:
        poll = min(1.0, self.timeout / 4)
        while not stop.wait(poll):
            last = self._last_progress
            if last is None:
                continue
            stuck = time.monotonic() - last
            if stuck > self.timeout:
                self._abort(stuck, directory)

    def _abort(self, stuck: float, directory: Path) -> NoReturn:
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
            self._dump_flight_recorder(trainer.world.rank, directory)
            self._report(stuck, directory)
        except Exception as exc:  # said, not raised: the process must end all the same
            print(f"HangWatchdog: the hang report failed: {type(exc).__name__}: {exc}",
                  file=sys.stderr, flush=True)
        finally:
            os._exit(1)

    def _report(self, stuck: float, directory: Path) -> None:
        """Write this rank's record and return once the verdict over it is printed, by this
        rank or another (``report_once``)."""
        trainer = self.trainer
        world = trainer.world
        config = trainer.config
        run = f"{config.project}/{config.group}/{config.experiment}#{world.env.restart_count}"
        write_record(directory, run, world.rank, world.world_size, trainer.global_step,
                     trainer.current_epoch, stuck, world.mesh)

        def emit(text: str) -> None:
            print(f"{text}\nHangWatchdog: the records are in {directory}; `dream-trainer "
                  f"diagnose {directory}` prints this verdict again", file=sys.stderr,
                  flush=True)

        report_once(directory, run, world.rank, world.world_size, self.report_wait, emit)

    def _dump_flight_recorder(self, rank: int, directory: Path) -> None:
        """Write the flight recorder's pickled entries, if a process group records them."""
        if not self.trainer.world.is_launched:
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
        path = write_file(directory, f"flight_recorder_{rank}", dump())
        print(f"HangWatchdog: flight recorder of rank {rank} written to {path}",
              file=sys.stderr, flush=True)
