"""HangWatchdog: its thread's lifetime, and real hung processes it ends with their stacks."""

from __future__ import annotations

import json
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
from dream_trainer.callbacks.hang_report import read_records, verdict
from dream_trainer.callbacks.hang_watchdog import HangWatchdog
from tests.helpers.launch import REPO, check, child_env, outputs_of, spawn_ranks
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
def test_hung_rank_and_its_blocked_peers_are_ended_with_their_stacks_and_a_verdict(
        tmp_path: Path) -> None:
    procs = spawn_ranks(SCRIPT, ["hang", str(tmp_path)], nproc=4)
    outputs = outputs_of(procs, timeout=300)
    ended = time.time()
    # Every rank was ended by its watchdog (rank 1 from inside its hour-long sleep).
    assert [proc.returncode for proc in procs] == [1, 1, 1, 1], outputs
    # Timed from the hang, not from the start: ranks importing torch on a busy CI machine
    # take a while, which says nothing about the watchdog. (The 6 s timeout, then the others'
    # records, which they wrote 2 s before.)
    hang_started = re.search(r"rank 1 hangs from ([\d.]+)", outputs[1])
    assert hang_started, outputs[1]
    assert ended - float(hang_started.group(1)) < 60, outputs
    # Rank 1 sleeps in training_step; the others wait for it in a collective of the same step.
    for rank, output in enumerate(outputs):
        timeout = 6 if rank == 1 else 4
        assert f"HangWatchdog: rank {rank} of 4 made no progress for" in output, output
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
    records = read_records(tmp_path)
    assert sorted(records) == [0, 1, 2, 3]
    # From the raw records: the group where rank 1 is one collective behind the others.
    behind = [(name, status["enqueued"]) for name, status in records[1]["status"].items()
              if any(records[r]["status"][name]["enqueued"] > status["enqueued"]
                     for r in (0, 2, 3))]
    assert len(behind) == 1, [record["status"] for record in records.values()]
    group, last = behind[0]
    assert all(records[r]["status"][group]["enqueued"] == last + 1 for r in (0, 2, 3))
    axis = records[0]["groups"][group]["axis"]
    line = next(number for number, text in enumerate(SCRIPT.read_text().splitlines(), 1)
                if text.strip().endswith("# the hang"))
    expected = (f"rank 1 never entered all_reduce #{last + 1} on {axis}; it is at "
                f"hang_run.py:{line} in training_step")
    assert expected in outputs[0], outputs[0]
    assert "ranks [0, 2, 3] entered all_reduce" in outputs[0], outputs[0]
    # The command line reads the same records to the same verdict.
    diagnosed = subprocess.run([sys.executable, "-m", "dream_trainer", "diagnose",
                                str(tmp_path)], env=child_env(), capture_output=True,
                               text=True, timeout=120)
    assert diagnosed.returncode == 0 and expected in diagnosed.stdout, diagnosed.stderr


def test_without_collective_records_the_verdict_comes_from_the_stacks(tmp_path: Path) -> None:
    def record(rank: int, stack: list[tuple[str, int, str]]) -> None:
        frames = [{"file": f, "line": n, "function": name} for f, n, name in stack]
        (tmp_path / f"hang_rank{rank}.json").write_text(json.dumps(
            {"run": "r", "written": 1.0, "rank": rank, "world_size": 3, "global_step": 7,
             "epoch": 0, "stuck_seconds": 5.0, "stack": frames, "groups": {},
             "recorder": None, "status": {}, "entries": []}))

    collective = "/x/torch/distributed/distributed_c10d.py"
    record(0, [("/job/train.py", 10, "main"), ("/job/train.py", 50, "training_step"),
               (collective, 3000, "all_reduce")])
    record(1, [("/job/train.py", 10, "main"), ("/job/train.py", 42, "training_step")])
    text = verdict(read_records(tmp_path))
    assert "no report" not in text and "no record from ranks [2]" in text, text
    assert "this verdict comes from the stacks alone" in text, text
    assert "ranks [0] wait in a collective; ranks [1] are not in one" in text, text
    assert "rank 1 is at train.py:42 in training_step" in text, text
    with pytest.raises(FileNotFoundError, match="HangWatchdog writes them"):
        read_records(tmp_path / "empty")


def test_slow_progress_setup_and_stop_training_are_not_hangs() -> None:
    result = check(subprocess.run([sys.executable, str(SCRIPT), "progress"], env=child_env(),
                                  capture_output=True, text=True, timeout=60))
    assert "survived; watching=False" in result.stdout
    assert "HangWatchdog" not in result.stderr
