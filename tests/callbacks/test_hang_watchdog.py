"""HangWatchdog: its thread's lifetime, and real hung processes it ends with their stacks."""

from __future__ import annotations

import json
import math
import os
import pickle
import re
import signal
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest

from dream_trainer.callbacks import Callback
from dream_trainer.callbacks.hang_report import read_records, verdict
from dream_trainer.callbacks.hang_watchdog import HangWatchdog
from tests.helpers.launch import REPO, check, child_env, free_port, outputs_of, spawn_ranks
from tests.helpers.toy import ToyTrainer, toy_config

SCRIPT = REPO / "tests/scripts/hang_run.py"


@pytest.fixture(autouse=True)
def _private_temp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The default trace_dir is made in the system's temporary directory: this test's."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))


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


def run_torchrun(arguments: list[str], env: dict[str, str], timeout: float) -> str:
    """Run the real torchrun agent with ``arguments``; return its stderr. Its workers share
    its session, so a launch that times out is ended whole."""
    agent = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", *arguments],
                             env=child_env(env), stdout=subprocess.DEVNULL,
                             stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        return agent.communicate(timeout=timeout)[1]
    finally:
        if agent.poll() is None:
            os.killpg(agent.pid, signal.SIGKILL)
            agent.wait()


@pytest.mark.distributed
def test_under_torchrun_the_verdict_is_printed_whichever_rank_fires_first(
        tmp_path: Path) -> None:
    # One launch of the real agent, which ends every rank once one exits; its restarts run the
    # hang three times, the watchdogs firing in the order hang_run.ORDERS forces each time:
    # rank 0 first and rank 1 last; rank 3 first and rank 0 last; rank 0 not at all.
    logs = tmp_path / "logs"
    agent = run_torchrun(["--nnodes=1", "--nproc_per_node=4", "--max-restarts=2",
                          "--rdzv_backend=c10d", f"--rdzv_endpoint=127.0.0.1:{free_port()}",
                          "--rdzv_id=hang-orders", f"--log-dir={logs}", "--redirects=3",
                          str(SCRIPT), "orders"], {"TMPDIR": str(tmp_path)}, timeout=400)
    # The default trace_dir, in this user's private directory: the ranks of an attempt (a run
    # of its own) agree on it.
    base = tmp_path / f"dream_trainer-{os.getuid()}"
    info = os.lstat(base)
    assert stat.S_ISDIR(info.st_mode) and stat.S_IMODE(info.st_mode) == 0o700, agent
    assert info.st_uid == os.getuid()
    line = next(number for number, text in enumerate(SCRIPT.read_text().splitlines(), 1)
                if text.strip().endswith("# the hang"))
    for attempt, (first, last) in enumerate([(0, 1), (3, 0), (None, None)]):
        outputs = [next(logs.glob(f"*/attempt_{attempt}/{rank}/stderr.log")).read_text()
                   for rank in range(4)]
        assert all(f"attempt {attempt} starts" in output for output in outputs), outputs
        trace_dir = base / f"toy/tests/attempt{attempt}/hang"
        records = read_records(trace_dir, f"toy/tests/attempt{attempt}#{attempt}")
        printed = [(rank, block) for rank, output in enumerate(outputs)
                   for block in output.split("hang verdict over ")[1:]]
        if first is None:
            # Rank 0 was ended before its watchdog fired: rank 1 printed what the others wrote.
            assert sorted(records) == [1, 2, 3], (attempt, outputs)
            assert "HangWatchdog: rank 0" not in outputs[0], outputs[0]
            assert any(rank == 1 and block.startswith("3 of 4 ranks") and
                       "\nno record from ranks [0]: they wrote none" in block
                       for rank, block in printed), (attempt, outputs)
            continue
        by_time = sorted(records, key=lambda rank: records[rank]["written"])
        assert (by_time[0], by_time[-1]) == (first, last), by_time
        # Printed once, by rank 0, whichever rank exited first and was ended by torchrun.
        assert [rank for rank, _ in printed] == [0], (attempt, outputs)
        block = printed[0][1]
        assert block.startswith("4 of 4 ranks (global steps: rank 0: 2, rank 1: 2, "), block
        assert "ranks [0, 2, 3] entered all_reduce" in block, block
        assert "rank 1 never entered all_reduce" in block, block
        assert f"hang_run.py:{line} in training_step" in block, block
        assert f"HangWatchdog: the records are in {trace_dir}" in block, block
    assert "exitcode  : 1" in agent, agent


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


def test_slow_progress_setup_and_stop_training_are_not_hangs(tmp_path: Path) -> None:
    result = check(subprocess.run([sys.executable, str(SCRIPT), "progress"],
                                  env=child_env({"TMPDIR": str(tmp_path)}),
                                  capture_output=True, text=True, timeout=60))
    assert "survived; watching=False" in result.stdout
    assert "HangWatchdog" not in result.stderr
