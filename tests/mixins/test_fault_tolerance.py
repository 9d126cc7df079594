"""Fault-tolerant replica groups (torchft): live groups keep training while one is killed and
restarted, the restarted group recovers from a peer, and without failures the groups train
exactly like DDP over the same ranks.

Each replica group is its own torchrun job of tests/scripts/ft_run.py; the lighthouse runs
in this process, or as `dream-trainer lighthouse` in a subprocess. Every process started here
is killed at the end of its test.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
from pydantic import ValidationError

from dream_trainer.configs import FaultToleranceParameters, TrainingParameters
from dream_trainer.mixins import (CheckpointConfigMixin, CheckpointMixin, FaultTolerantConfigMixin,
                                  FaultTolerantMixin)
from tests.helpers.launch import REPO, check, child_env, free_port, torchrun
from tests.helpers.toy import ToyConfig, ToyTrainer

SCRIPT = REPO / "tests" / "scripts" / "ft_run.py"
# Fast quorums and failure detection for a test on one machine (torchft's defaults are for
# clusters: a 60 s join timeout, 5 s heartbeats).
LIGHTHOUSE_TIMING = {"join_timeout_ms": 500, "quorum_tick_ms": 20, "heartbeat_timeout_ms": 2000}
KILL_AT_STEP = 10
# Steps between the last one the test saw and the one every group stops at: each group reads
# the stop file once per step, and must not have passed it by then.
STOP_MARGIN = 40


# -- processes -------------------------------------------------------------------------------
@contextlib.contextmanager
def lighthouse(min_replicas: int) -> Iterator[str]:
    """A lighthouse in this process, on a free port; yields its address."""
    from torchft.coordination import LighthouseServer

    server = LighthouseServer(bind=f"[::]:{free_port()}", min_replicas=min_replicas,
                              **LIGHTHOUSE_TIMING)
    try:
        yield server.address()
    finally:
        server.shutdown()


@contextlib.contextmanager
def lighthouse_command(min_replicas: int) -> Iterator[str]:
    """`dream-trainer lighthouse` in a subprocess; yields the address it prints, and checks
    that SIGTERM stops it cleanly."""
    timing = [part for name, value in LIGHTHOUSE_TIMING.items()
              for part in (f"--{name.removesuffix('_ms').replace('_', '-')}-ms", str(value))]
    proc = subprocess.Popen(
        [sys.executable, "-m", "dream_trainer", "lighthouse", "--min-replicas",
         str(min_replicas), "--bind", f"[::]:{free_port()}", *timing],
        env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
        start_new_session=True)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.startswith("lighthouse listening on http://"), line
        yield line.split()[3]
        proc.send_signal(signal.SIGTERM)
        rest = proc.communicate(timeout=30)[0]
        assert proc.returncode == 0 and "lighthouse stopped" in rest, (proc.returncode, rest)
    finally:
        _kill_group(proc.pid)


class Group:
    """One replica group: a torchrun job that restarts its workers if they die (twice at
    most: the test kills them once; the second restart absorbs a start that failed under load)."""

    def __init__(self, out: Path, replica_id: int, groups: int, nproc: int, min_replicas: int,
                 address: str, extra: list[str]) -> None:
        self.out, self.replica_id, self.nproc = out, replica_id, nproc
        self.log = (out / f"torchrun_{replica_id}.log").open("w")
        command = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
                   "--max-restarts=2", "--monitor-interval=0.2", "--rdzv_backend=c10d",
                   f"--rdzv_endpoint=127.0.0.1:{free_port()}", str(SCRIPT), "--out", str(out),
                   "--replica-id", str(replica_id), "--groups", str(groups), "--min-replicas",
                   str(min_replicas), "--lighthouse", address, "--dp-shard", str(nproc), *extra]
        self.proc = subprocess.Popen(command, env=child_env(), stdout=self.log,
                                     stderr=subprocess.STDOUT, start_new_session=True)

    def records(self) -> list[dict[str, Any]]:
        path = self.out / f"replica_{self.replica_id}.jsonl"
        if not path.exists():
            return []
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]

    def last_step(self) -> int:
        records = self.records()
        return records[-1]["global_step"] if records else 0

    def worker_pids(self) -> list[int]:
        return [int((self.out / f"pid_{self.replica_id}_{rank}").read_text())
                for rank in range(self.nproc)]

    def kill_workers(self) -> None:
        for pid in self.worker_pids():
            # Only a process still running this group's script: a pid from a file may have
            # been reused once its worker ended.
            with contextlib.suppress(OSError):
                command = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
                if SCRIPT.name.encode() in b" ".join(command) \
                        and str(self.out).encode() in command:
                    os.kill(pid, signal.SIGKILL)

    def wait(self, timeout: float) -> int:
        return self.proc.wait(timeout=timeout)

    def output(self) -> str:
        self.log.flush()
        return (self.out / f"torchrun_{self.replica_id}.log").read_text()

    def close(self) -> None:
        # torchrun starts its workers in sessions of their own: kill them by pid too.
        _kill_group(self.proc.pid)
        with contextlib.suppress(OSError, ValueError):
            self.kill_workers()
        self.proc.wait(timeout=30)
        self.log.close()


@contextlib.contextmanager
def replica_groups(out: Path, groups: int, nproc: int, min_replicas: int, address: str,
                   extra: Sequence[str] = ()) -> Iterator[list[Group]]:
    started = [Group(out, r, groups, nproc, min_replicas, address, list(extra))
               for r in range(groups)]
    try:
        yield started
    finally:
        for group in started:
            group.close()


def _kill_group(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)


def wait_for(condition: Callable[[], bool], timeout: float, what: str,
             groups: list[Group]) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        for group in groups:
            if group.proc.poll() is not None:
                raise AssertionError(f"replica group {group.replica_id} exited while waiting "
                                     f"for {what}:\n{group.output()[-4000:]}")
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}:\n"
                                 + "\n".join(g.output()[-2000:] for g in groups))
        time.sleep(0.05)


def finish(groups: list[Group], timeout: float) -> None:
    for group in groups:
        code = group.wait(timeout)
        assert code == 0, f"replica group {group.replica_id} exited with {code}:\n" \
                          f"{group.output()[-6000:]}"


def weights(out: Path, name: str) -> dict[str, torch.Tensor]:
    return {key.removeprefix("module."): value
            for key, value in torch.load(out / f"weights_{name}.pt").items()}


def assert_steps_advance(entries: list[dict[str, Any]]) -> None:
    """Each record is one step past the one before, or further ahead with a recovery of a
    peer's state: a group never skips steps on its own. (On a loaded machine a group slower
    than the lighthouse's join timeout can miss a quorum that the others form without it; it
    then catches up by recovering.)"""
    for previous, entry in zip(entries, entries[1:]):
        step = previous["global_step"] + 1
        assert entry["global_step"] == step or (
            entry["global_step"] > step and entry["recoveries"] > previous["recoveries"]), \
            (previous, entry)


def logged_steps(out: Path, replica_id: int) -> list[int]:
    path = out / "logs" / "ft" / "tests" / "run" / "logs" / f"replica_{replica_id}" / \
        "metrics.jsonl"
    return [record["step"] for record in map(json.loads, path.read_text().splitlines())
            if "loss" in record]


# -- a group killed mid-run ------------------------------------------------------------------
@pytest.mark.distributed
@pytest.mark.parametrize(("groups", "nproc", "min_replicas"), [(3, 1, 2), (2, 2, 1)],
                         ids=["3_groups_of_1_rank", "2_fsdp_groups_of_2_ranks"])
def test_live_groups_keep_training_while_a_killed_group_restarts_and_recovers(
        tmp_path: Path, groups: int, nproc: int, min_replicas: int) -> None:
    stop_file, gate = tmp_path / "stop", tmp_path / "restart_gate"
    victim = groups - 1
    with lighthouse(min_replicas) as address, \
            replica_groups(tmp_path, groups, nproc, min_replicas, address,
                           ["--stop-file", str(stop_file), "--step-delay", "0.02",
                            "--callbacks", "--restart-gate", str(gate)]) as started:
        # Killed once every group trains, each for at least two steps with all the others
        # (a group that started late under load joins by recovering; after one step only it
        # could have joined at the very step of the kill).
        def all_training() -> bool:
            return started[victim].last_step() >= KILL_AT_STEP and all(
                sum(r["participants"] == groups for r in group.records()) >= 2
                for group in started)

        wait_for(all_training, 120, f"every group to train, and step {KILL_AT_STEP}", started)
        old_pids = set(started[victim].worker_pids())
        started[victim].kill_workers()
        killed_at = max(group.last_step() for group in started)

        # The restarted group waits at the gate until every live group has committed a step
        # without it. Otherwise a fast restart could make the point moot: with gloo a live
        # group can sit in the failed step's collective, waiting on a live peer that gave it
        # up, until that peer's next quorum (which the restarted group can complete) or the
        # 20 s timeout.
        def live_groups_went_on() -> bool:
            return all(any(r["global_step"] > killed_at and r["committed"]
                           and r["participants"] == groups - 1 for r in group.records())
                       for group in started if group.replica_id != victim)

        wait_for(live_groups_went_on, 120, "the live groups to commit a step on their own",
                 started)
        gate.touch()

        def rejoined() -> bool:
            return any(r["pid"] not in old_pids and r["committed"]
                       and r["participants"] == groups for r in started[victim].records())

        wait_for(rejoined, 120, "the killed group to rejoin", started)
        stop = max(group.last_step() for group in started) + STOP_MARGIN
        stop_file.write_text(str(stop))
        finish(started, 120)
        records = {group.replica_id: group.records() for group in started}

    for replica_id, entries in records.items():
        steps = [entry["global_step"] for entry in entries]
        committed = [entry["committed_steps"] for entry in entries]
        assert steps[-1] == stop, (replica_id, steps[-5:])
        # No step commits with fewer than min_replicas groups.
        assert all(e["participants"] >= min_replicas for e in entries if e["committed"]), \
            replica_id
        assert committed == sorted(committed), replica_id
        # The JSON logger wrote every step once, across the restart too.
        logged = logged_steps(tmp_path, replica_id)
        assert logged == sorted(set(logged)), replica_id
        if replica_id == victim:
            continue
        # A live group trained from before the kill to the end (from step 1, or from where it
        # first joined if the quorum formed before it was up), never going back or skipping.
        assert steps[0] < killed_at, (replica_id, steps[:3])
        assert_steps_advance(entries)
        # It went on without the killed group (the gate held that group back until it had).
        alone = [e for e in entries if e["global_step"] > killed_at and e["committed"]
                 and e["participants"] == groups - 1]
        assert alone, f"replica group {replica_id} committed no step without the killed group"

    before = [e for e in records[victim] if e["pid"] in old_pids]
    after = [e for e in records[victim] if e["pid"] not in old_pids]
    assert before[-1]["global_step"] >= KILL_AT_STEP
    # Restarted, it started from a live peer's state (no checkpoint exists: checkpoints are
    # off), ahead of where it was killed, and went on with the others.
    assert after[0]["recoveries"] >= 1 and after[0]["global_step"] > killed_at, after[:3]
    assert_steps_advance(after)
    assert after[-1]["global_step"] == stop
    assert not list(tmp_path.glob("checkpoints/**/step_*"))

    reference = weights(tmp_path, "0")
    for replica_id in range(1, groups):
        for name, tensor in weights(tmp_path, str(replica_id)).items():
            assert torch.equal(tensor, reference[name]), (replica_id, name)


# -- no failure: exactly DDP; a full restart resumes from each group's checkpoint -----------
@pytest.mark.distributed
def test_two_groups_train_exactly_like_ddp_and_resume_from_their_checkpoints(
        tmp_path: Path) -> None:
    ddp_out, ft_out = tmp_path / "ddp", tmp_path / "ft"
    ddp_out.mkdir()
    ft_out.mkdir()
    with lighthouse_command(2) as address:
        # Stopped after 10 steps with a checkpoint, then the same command again to step 16:
        # every group resumes from its own checkpoint (no group is behind, so none recovers).
        for max_steps in (10, 16):
            with replica_groups(ft_out, 2, 1, 2, address,
                                ["--checkpoint", "--weighting", "--max-steps",
                                 str(max_steps)]) as started:
                if max_steps == 10:  # the reference, meanwhile
                    check(torchrun(SCRIPT, ["--mode", "ddp", "--out", str(ddp_out),
                                            "--max-steps", "16", "--weighting"],
                                   nproc=2, timeout=120))
                finish(started, 120)
                records = {group.replica_id: group.records() for group in started}
    ddp = {e["global_step"]: e["loss"] for e in json.loads(
        "[" + ",".join((ddp_out / "ddp.jsonl").read_text().splitlines()) + "]")}
    for replica_id, entries in records.items():
        assert [e["global_step"] for e in entries] == list(range(1, 17))
        assert all(e["committed"] and e["participants"] == 2 for e in entries)
        assert [e["committed_steps"] for e in entries] == list(range(1, 17))
        checkpoints = ft_out / "checkpoints" / "ft" / "tests" / "run" / "checkpoints"
        assert sorted(p.name for p in (checkpoints / f"replica_{replica_id}").glob("step_*")) \
            == ["step_10", "step_16"]
        # The resumed run recovered nothing: it read its own checkpoint.
        assert all(e["recoveries"] == 0 for e in entries if e["global_step"] > 10)
    # Group 0 read DDP rank 0's share of every batch, so its losses are rank 0's.
    assert [e["loss"] for e in records[0]] == [ddp[step] for step in range(1, 17)]
    reference = weights(ddp_out, "ddp")
    for replica_id in (0, 1):
        for name, tensor in weights(ft_out, str(replica_id)).items():
            assert torch.equal(tensor, reference[name]), (replica_id, name)


# -- errors --------------------------------------------------------------------------------
class FTToyConfig(ToyConfig, FaultTolerantConfigMixin):
    pass


class FTToy(FaultTolerantMixin, ToyTrainer):
    pass


def test_an_unreachable_lighthouse_is_an_error_naming_its_address_within_the_timeout() -> None:
    address = f"http://127.0.0.1:{free_port()}"
    config = FTToyConfig(
        project="toy", group="tests", experiment="ft",
        training_parameters=TrainingParameters(n_epochs=1, train_batch_size=8),
        fault_tolerance_parameters=FaultToleranceParameters(
            lighthouse=address, connect_timeout=timedelta(seconds=1)))
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=f"cannot reach the torchft lighthouse at "
                                           f"{address} within connect_timeout=1s"):
        FTToy(config).fit()
    assert time.monotonic() - start < 30


def test_too_few_groups_for_a_quorum_is_an_error_within_the_quorum_timeout() -> None:
    with lighthouse(min_replicas=2) as address:
        config = FTToyConfig(
            project="toy", group="tests", experiment="ft",
            training_parameters=TrainingParameters(n_epochs=1, train_batch_size=8),
            fault_tolerance_parameters=FaultToleranceParameters(
                lighthouse=address, replica_groups=2, min_replicas=2,
                quorum_timeout=timedelta(seconds=1)))
        trainer = FTToy(config)
        with pytest.raises(RuntimeError, match="no quorum of at least 2 replica group.s. "
                                               f"formed at the lighthouse {address} within "
                                               "quorum_timeout=1s"):
            trainer.fit()
    assert trainer.global_step == 0 and trainer.committed_steps == 0


def test_a_mixin_listed_before_it_is_refused() -> None:
    class Late(CheckpointMixin, FTToy):
        pass

    class LateConfig(FTToyConfig, CheckpointConfigMixin):
        pass

    config = LateConfig(project="p", group="g", experiment="e",
                        training_parameters=TrainingParameters(n_epochs=1, train_batch_size=1))
    with pytest.raises(TypeError, match="lists CheckpointMixin before FaultTolerantMixin"):
        Late(config)


@pytest.mark.parametrize(("fields", "message"), [
    ({"replica_id": 2, "replica_groups": 2}, "replica_id=2 is not below replica_groups=2"),
    ({"min_replicas": 3, "replica_groups": 2}, "min_replicas=3 exceeds replica_groups=2"),
    ({"lighthouse": "localhost:29510"}, "give it as http://HOST:PORT"),
    ({"quorum_timeout": timedelta(0)}, "quorum_timeout must be a positive duration"),
])
def test_bad_settings_are_validation_errors(fields: dict[str, Any], message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        FaultToleranceParameters(**fields)


def test_each_group_reads_its_own_share_of_the_training_data() -> None:
    shares = []
    for replica_id in range(3):
        config = FTToyConfig(project="toy", group="tests", experiment="ft", n_samples=24,
                             training_parameters=TrainingParameters(n_epochs=1,
                                                                    train_batch_size=4),
                             fault_tolerance_parameters=FaultToleranceParameters(
                                 replica_id=replica_id, replica_groups=3))
        trainer = FTToy(config)
        trainer.world.launch()
        try:
            trainer.build_models()
            trainer.build_training()
            shares.append([i for batch in trainer.train_dataloader.batch_sampler
                           for i in batch])
        finally:
            trainer.world.shutdown()
    assert [len(share) for share in shares] == [8, 8, 8]
    assert sorted(i for share in shares for i in share) == list(range(24))


def test_the_lighthouse_command_names_its_options_and_a_port_it_cannot_bind(
        capsys: pytest.CaptureFixture[str]) -> None:
    import socket

    from dream_trainer.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(["lighthouse", "--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    for option in ("--min-replicas", "--bind", "--join-timeout-ms", "--quorum-tick-ms",
                   "--heartbeat-timeout-ms"):
        assert option in out, option
    with socket.socket(socket.AF_INET6) as taken:
        taken.bind(("::", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(["lighthouse", "--min-replicas", "1", "--bind", f"[::]:{port}"]) == 1
    assert f"cannot serve a lighthouse on [::]:{port}" in capsys.readouterr().err


def test_without_torchft_the_errors_name_the_extra(monkeypatch: pytest.MonkeyPatch,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    from dream_trainer.cli import main
    from dream_trainer.ft.replica_group import import_torchft

    monkeypatch.setitem(sys.modules, "torchft", None)  # what an absent package looks like
    monkeypatch.setitem(sys.modules, "torchft.coordination", None)
    with pytest.raises(ImportError, match=r"pip install 'dream-trainer\[ft\]'"):
        import_torchft()
    assert main(["lighthouse", "--min-replicas", "1"]) == 1
    assert "pip install 'dream-trainer[ft]'" in capsys.readouterr().err

