"""HangWatchdog: its thread's lifetime, and real hung processes it ends with their stacks."""

from __future__ import annotations

import math
import pickle
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from dream_trainer.callbacks import Callback
from dream_trainer.callbacks.hang_watchdog import HangWatchdog
from tests.helpers.launch import REPO, check, child_env, spawn_ranks
from tests.helpers.toy import ToyTrainer, toy_config

SCRIPT = REPO / "tests/scripts/hang_run.py"


class WatchingProbe(Callback):
    def __init__(self, watchdog: HangWatchdog) -> None:
        self.watchdog = watchdog
        self.watching: set[bool] = set()

    def post_train_batch(self, result: dict[str, Any], batch_idx: int) -> None:
        self.watching.add(self.watchdog.watching)


class FailsAtStepThree(ToyTrainer):
    def training_step(self, batch: Any, batch_idx: int) -> dict[str, Any]:
        if self.global_step == 3:
            raise RuntimeError("injected failure")
        return super().training_step(batch, batch_idx)


def test_thread_runs_during_fit_and_stops_after() -> None:
    watchdog = HangWatchdog(timeout=60)
    probe = WatchingProbe(watchdog)
    ToyTrainer(toy_config(callbacks=[watchdog, probe])).fit()
    assert probe.watching == {True}
    assert not watchdog.watching


def test_thread_stops_when_fit_fails() -> None:
    watchdog = HangWatchdog(timeout=60)
    probe = WatchingProbe(watchdog)
    with pytest.raises(RuntimeError, match="injected failure"):
        FailsAtStepThree(toy_config(callbacks=[watchdog, probe])).fit()
    assert probe.watching == {True}
    assert not watchdog.watching


@pytest.mark.parametrize("timeout", [0, -1.0, math.nan, math.inf])
def test_timeout_must_be_positive_and_finite(timeout: float) -> None:
    with pytest.raises(ValueError, match="timeout must be a positive number of seconds"):
        HangWatchdog(timeout)


@pytest.mark.distributed
def test_hung_rank_and_its_blocked_peer_are_ended_with_their_stacks(tmp_path: Path) -> None:
    procs = spawn_ranks(SCRIPT, ["hang", str(tmp_path)])
    outputs = []
    try:
        for proc in procs:
            outputs.append(proc.communicate(timeout=120)[0])
    finally:
        for proc in procs:
            proc.kill()
    ended = time.time()
    assert [proc.returncode for proc in procs] == [1, 1], outputs
    # Timed from the hang, not from the start: two ranks importing torch on a busy CI machine
    # take a while, which says nothing about the watchdog.
    hang_started = re.search(r"rank 1 hangs from ([\d.]+)", outputs[1])
    assert hang_started, outputs[1]
    assert ended - float(hang_started.group(1)) < 30, outputs
    # Rank 1 sleeps in training_step; rank 0 waits for it in a collective of the same step.
    for rank, timeout, output in ((0, 3, outputs[0]), (1, 5, outputs[1])):
        assert f"HangWatchdog: rank {rank} of 2 made no progress for" in output, output
        assert f"(timeout {timeout} s) at global step 2, epoch 0" in output, output
        assert "Thread 0x" in output and "hang_run.py" in output, output
        assert " in training_step" in output, output
        assert "finished without hanging" not in output, output
        assert f"flight recorder of rank {rank} written to {tmp_path}" in output, output
    # The flight recorders: rank 0's last collective (the step's gradient all-reduce) is still
    # in flight ("retired" False), because rank 1 never joined it; rank 1's collectives all
    # finished, one fewer.
    dumps = [pickle.loads((tmp_path / f"flight_recorder_{rank}").read_bytes()) for rank in (0, 1)]
    last = [dump["entries"][-1] for dump in dumps]
    assert last[0]["profiling_name"] == "gloo:all_reduce" and not last[0]["retired"], last
    assert all(entry["retired"] for entry in dumps[1]["entries"]), last
    assert last[0]["collective_seq_id"] == last[1]["collective_seq_id"] + 1, last


def test_slow_progress_setup_and_stop_training_are_not_hangs() -> None:
    result = check(subprocess.run([sys.executable, str(SCRIPT), "progress"], env=child_env(),
                                  capture_output=True, text=True, timeout=60))
    assert "survived; watching=False" in result.stdout
    assert "HangWatchdog" not in result.stderr
