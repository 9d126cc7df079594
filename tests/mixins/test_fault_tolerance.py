"""Fault-tolerant replica groups (torchft): live groups keep training while one is killed and
restarted, the restarted group recovers from a peer, and without failures the groups train
exactly like DDP over the same ranks. Every listener (the lighthouse's and each worker's) is
on 127.0.0.1 unless configured otherwise, and a peer's state is refused, with nothing of it
run or applied, unless it is a plausible state in the library's own format (and, with a
shared secret, signed).

Each replica group is its own torchrun job of tests/scripts/ft_run.py; the lighthouse runs
in this process, or as `dream-trainer lighthouse` in a subprocess. Every process started here
is killed at the end of its test.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import logging
import os
import pickle
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from datetime import timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import torch
from pydantic import ValidationError

from dream_trainer.callbacks import Callback
from dream_trainer.cli.lighthouse import DEFAULT_BIND
from dream_trainer.configs import FaultToleranceParameters, TrainingParameters
from dream_trainer.errors import RecoveryError
from dream_trainer.ft.transport import TOKEN_HEADER, StateTransport, request_token
from dream_trainer.ft.wire import MAGIC, WireError, decode, encode
from dream_trainer.mixins import (CheckpointConfigMixin, CheckpointMixin, FaultTolerantConfigMixin,
                                  FaultTolerantMixin)
from tests.helpers.launch import REPO, check, child_env, free_port, torchrun
from tests.helpers.toy import ToyConfig, ToyTrainer
from tests.scripts.ft_run import listening_sockets

SCRIPT = REPO / "tests" / "scripts" / "ft_run.py"
# Fast quorums and failure detection for a test on one machine (torchft's defaults are for
# clusters: a 60 s join timeout, 5 s heartbeats).
LIGHTHOUSE_TIMING = {"join_timeout_ms": 500, "quorum_tick_ms": 20, "heartbeat_timeout_ms": 2000}
KILL_AT_STEP = 10
# Steps between the last one the test saw and the one every group stops at: each group reads
# the stop file once per step, and must not have passed it by then.
STOP_MARGIN = 40
LOOPBACK = "127.0.0.1"
DEFAULT_HOST = DEFAULT_BIND.rsplit(":", 1)[0]


# -- processes -------------------------------------------------------------------------------
@contextlib.contextmanager
def lighthouse(min_replicas: int) -> Iterator[str]:
    """A lighthouse in this process, on the command's default host and a free port; yields
    its address, once its socket is checked to listen there only."""
    from dream_trainer.cli.lighthouse import start

    port = free_port()
    server, address = start(f"{DEFAULT_HOST}:{port}", min_replicas, **LIGHTHOUSE_TIMING)
    try:
        assert [entry for entry in listening_sockets() if entry[1] == port] \
            == [(LOOPBACK, port)]
        assert address == f"http://{LOOPBACK}:{port}"
        yield address
    finally:
        server.shutdown()


@contextlib.contextmanager
def lighthouse_command(min_replicas: int) -> Iterator[str]:
    """`dream-trainer lighthouse` in a subprocess; yields the address it prints, and checks
    that SIGTERM stops it cleanly."""
    timing = [part for name, value in LIGHTHOUSE_TIMING.items()
              for part in (f"--{name.removesuffix('_ms').replace('_', '-')}-ms", str(value))]
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "dream_trainer", "lighthouse", "--min-replicas",
         str(min_replicas), "--bind", f"{DEFAULT_HOST}:{port}", *timing],
        env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
        start_new_session=True)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.startswith(f"lighthouse listening on http://{LOOPBACK}:{port} "), line
        # Its only listener is on loopback.
        assert listening_sockets(proc.pid) == [(LOOPBACK, port)]
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
        # The group's own process group (torch.distributed's, not fault tolerance's) listens
        # where GLOO_SOCKET_IFNAME says: loopback here too, so that every listener of a worker
        # is on loopback whatever this host's name resolves to.
        self.proc = subprocess.Popen(command, env=child_env({"GLOO_SOCKET_IFNAME": "lo"}),
                                     stdout=self.log, stderr=subprocess.STDOUT,
                                     start_new_session=True)

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


def assert_listeners_on_loopback(out: Path, groups: int, nproc: int) -> None:
    """Every socket each worker listened on once it trained with another group is on
    127.0.0.1: on rank 0 its manager, store, state server and gloo, on the others the last
    two (the report lists every listening socket of the process); and the state a peer
    copies went through dream_trainer's transport, not torchft's pickling one."""
    for replica_id in range(groups):
        for rank in range(nproc):
            report = json.loads((out / f"listeners_{replica_id}_{rank}.json").read_text())
            found = report["listening"]
            assert {host for host, _ in found} == {LOOPBACK}, (replica_id, rank, found)
            assert len(found) >= (4 if rank == 0 else 2), (replica_id, rank, found)
            assert report["transport"] == "StateTransport", report


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
        # The one update vote counted every step that did not commit, under its cause.
        for previous, entry in zip(entries, entries[1:]):
            if (entry["pid"], entry["recoveries"]) == (previous["pid"], previous["recoveries"]):
                assert entry["not_committed"] - previous["not_committed"] \
                    == (not entry["committed"]), (replica_id, previous, entry)

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
    assert_listeners_on_loopback(tmp_path, groups, nproc)


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
    assert_listeners_on_loopback(ft_out, 2, 1)


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
    # This host only, unless told otherwise.
    assert "default: 127.0.0.1:29510, this host only" in " ".join(out.split())
    with socket.socket(socket.AF_INET) as taken:
        taken.bind((LOOPBACK, 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(["lighthouse", "--min-replicas", "1", "--bind", f"{LOOPBACK}:{port}"]) == 1
        assert f"cannot serve a lighthouse on {LOOPBACK}:{port}" in capsys.readouterr().err
        # Every interface is allowed, with a warning first (here it cannot bind either).
        assert main(["lighthouse", "--min-replicas", "1", "--bind", f"0.0.0.0:{port}"]) == 1
    err = " ".join(capsys.readouterr().err.split())
    assert err.startswith("warning: the lighthouse listens on every network interface "
                          "(0.0.0.0)"), err
    assert "docs/reliability.md#security" in err and "can end any replica group" in err


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



# -- a peer's state ------------------------------------------------------------------------
class Planted:
    """Unpickling it creates a file: what a peer posing as a replica group sent torchft's
    own transport to run code in the worker."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (Path.touch, (self.marker,))


@contextlib.contextmanager
def fake_peer(body: bytes) -> Iterator[str]:
    """An HTTP server on loopback answering every GET with ``body``; yields the metadata a
    peer would advertise for it."""

    class Answer(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer((LOOPBACK, 0), Answer)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://{LOOPBACK}:{server.server_address[1]}/state/"
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


@contextlib.contextmanager
def transport(secret: bytes | None = None,
              check: Callable[[Any, int], None] = lambda state, step: None,
              max_bytes: int = 2**30) -> Iterator[StateTransport]:
    made = StateTransport(LOOPBACK, LOOPBACK, timedelta(seconds=10), secret, check,
                          lambda: max_bytes)
    try:
        yield made
    finally:
        made.shutdown()


def peer_state(step: int) -> dict[str, Any]:
    return {"user": {"default": {"w": torch.arange(6.0).reshape(2, 3), "lr": 0.1,
                                 "state": {0: {"step": torch.tensor(3.0)}}}},
            "torchft": {"step": step, "batches_committed": 2 * step}}


def test_a_peer_answering_with_a_pickle_is_refused_before_anything_of_it_runs(
        tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    payload = pickle.dumps({"user": {"default": Planted(marker)}, "torchft": {"step": 5}})
    with fake_peer(payload) as metadata, transport() as receiver:
        with pytest.raises(RecoveryError, match=f"refused the state offered by the peer at "
                                                f"{metadata}5: .*does not start with this "
                                                "format's marker .*a pickle"):
            receiver.recv_checkpoint(0, metadata, 5, timedelta(seconds=10))
    assert not marker.exists()
    # The payload is live: what torchft's own transport did with it ran the planted code.
    pickle.loads(payload)
    assert marker.exists()


def test_a_state_crosses_the_wire_exactly_and_a_peer_must_serve_the_step_asked() -> None:
    state = peer_state(7)
    with transport() as sender, transport() as receiver, transport(max_bytes=100) as small:
        sender.send_checkpoint([1], 7, state, timedelta(seconds=10))
        received = receiver.recv_checkpoint(0, sender.metadata(), 7, timedelta(seconds=10))
        # An answer larger than the receiver's models could explain is not even read.
        with pytest.raises(RecoveryError, match=r"it announced \d+ bytes, more than the 100 "):
            small.recv_checkpoint(0, sender.metadata(), 7, timedelta(seconds=10))
        with pytest.raises(RecoveryError, match="HTTP 409 .serving the state of step 7, not 8"):
            receiver.recv_checkpoint(0, sender.metadata(), 8, timedelta(seconds=10))
        with pytest.raises(RecoveryError, match="advertised 'file:///etc/passwd', not "
                                                r"http://HOST:PORT/state/"):
            receiver.recv_checkpoint(0, "file:///etc/passwd", 7, timedelta(seconds=10))
    assert received["torchft"] == {"step": 7, "batches_committed": 14}
    mine = received["user"]["default"]
    assert torch.equal(mine["w"], state["user"]["default"]["w"]) and mine["lr"] == 0.1
    # Optimizer states key by int: the key comes back an int.
    assert list(mine["state"]) == [0] and mine["state"][0]["step"].item() == 3.0


def test_with_a_secret_only_signed_requests_and_answers_are_accepted() -> None:
    secret, other = b"s" * 32, b"o" * 32
    with transport(secret) as sender, transport(secret) as receiver, \
            transport(other) as stranger, transport() as plain:
        sender.send_checkpoint([1], 3, peer_state(3), timedelta(seconds=10))
        url = f"{sender.metadata()}3"
        host, port = url.removeprefix("http://").split("/")[0].split(":")
        # A request without the token, or with one for another URL, gets nothing.
        for headers in ({}, {TOKEN_HEADER: request_token(secret, f"{sender.metadata()}4")}):
            connection = http.client.HTTPConnection(host, int(port), timeout=10)
            connection.request("GET", "/state/3", headers=headers)
            response = connection.getresponse()
            body = response.read()
            connection.close()
            assert response.status == 403 and not body.startswith(MAGIC), (headers, body)
        received = receiver.recv_checkpoint(0, sender.metadata(), 3, timedelta(seconds=10))
        assert received["torchft"]["step"] == 3
        with pytest.raises(RecoveryError, match="HTTP 403 .*set the same "
                                                "DREAM_TRAINER_FT_SECRET on every replica"):
            stranger.recv_checkpoint(0, sender.metadata(), 3, timedelta(seconds=10))
        # A server without the secret sends an unsigned answer, a fake one a well-formed
        # state with a forged signature: both refused before they are parsed.
        plain.send_checkpoint([1], 3, peer_state(3), timedelta(seconds=10))
        forged = b"".join(map(bytes, encode(peer_state(3)).chunks())) + bytes(32)
        with fake_peer(forged) as fake:
            for metadata in (plain.metadata(), fake):
                with pytest.raises(RecoveryError, match="not signed with this group's "
                                                        "DREAM_TRAINER_FT_SECRET"):
                    receiver.recv_checkpoint(0, metadata, 3, timedelta(seconds=10))


def test_a_secret_too_short_is_refused_without_showing_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from dream_trainer.ft.transport import secret_from_env

    monkeypatch.setenv("DREAM_TRAINER_FT_SECRET", "hunter2")
    with pytest.raises(ValueError, match="has 7 characters: use at least 16") as error:
        secret_from_env()
    assert "hunter2" not in str(error.value)
    monkeypatch.setenv("DREAM_TRAINER_FT_SECRET", "x" * 16)
    assert secret_from_env() == b"x" * 16


def crafted(header: Any, data: bytes = b"") -> bytearray:
    """A payload of this format around ``header`` (JSON text or a value), as an attacker
    would write one."""
    text = header if isinstance(header, bytes) else json.dumps(header).encode()
    payload = bytearray(MAGIC + len(text).to_bytes(8, "little") + text)
    payload += bytes(-len(payload) % 64) + data
    return payload


@pytest.mark.parametrize(("payload", "message"), [
    (crafted(b'{"tree": 1}'), "a JSON object, which this format never writes"),
    (crafted([[], ["d", [["lr", 0.5]]]]), "an untagged number '0.5'"),
    (crafted([[], ["builtins.eval", "1"]]), r"state is not a value of this format"),
    (crafted([[["float32", [4], 0]], ["T", 0]], bytes(8)),
     "tensor 0 lies at bytes 0 to 16 of the data, which overlap .* run past the 8 bytes"),
    (crafted([[["object", [1], 0]], ["T", 0]], bytes(8)),
     "tensor 0 of its table is not \\[dtype, shape, offset\\]"),
    (crafted([[], ["d", [[["l", []], 1]]]]), "has a key that is not hashable"),
    (crafted([[], ["d", [["a", 1], ["a", 2]]]]), "repeats a key"),
    (crafted(b'[[],' + b'["l",[' * 70 + b']]' * 70 + b']'), "nests deeper than 64 levels"),
    (crafted(b'[[],' + b'[' * 100_000 + b']' * 100_000 + b']'), "nests deeper than 64 levels"),
    (crafted([[], ["l", [["l", []], ["t", []]]]]), None),
])
def test_a_malformed_state_is_refused_naming_the_problem(payload: bytearray,
                                                         message: str | None) -> None:
    if message is None:  # a well-formed payload, as a control
        assert decode(payload, "http://peer:1/state/3") == [[], ()]
        return
    with pytest.raises(WireError, match="the state sent by http://peer:1/state/3 is "
                                        f"refused: .*({message})"):
        decode(payload, "http://peer:1/state/3")


def test_a_dict_of_colliding_int_keys_is_refused_quickly() -> None:
    # 200,000 distinct ints that all hash to 0: a dict would take minutes to build from them.
    keys = [i * (2**61 - 1) for i in range(1, 200_000)]
    payload = crafted([[], ["d", [["optimizer", ["d", [[key, None] for key in keys]]]]]])
    start = time.monotonic()
    with pytest.raises(WireError, match=r"the dict at state\['optimizer'\] sent by "
                                        "http://peer:1/state/3 holds more than 64 distinct "
                                        "keys with the same hash"):
        decode(payload, "http://peer:1/state/3")
    assert time.monotonic() - start < 5


def test_a_state_the_wire_cannot_carry_is_refused_naming_the_value() -> None:
    with pytest.raises(TypeError, match=r"state\['callbacks'\]\['Mine'\]\['when'\] is a "
                                        r"datetime.timedelta, which a recovering replica "
                                        "group cannot receive"):
        encode({"callbacks": {"Mine": {"when": timedelta(seconds=1)}}})


class FTPlausibility(Callback[FaultTolerantMixin]):
    """After the first committed step, offers this trainer's group a peer's state through
    its own transport: a plausible one, then the same with one thing wrong each time."""

    def __init__(self) -> None:
        self.outcomes: dict[str, str] = {}
        self.listeners: list[tuple[str, int]] = []
        self.ports: dict[str, int] = {}

    def post_train_batch(self, result: dict[str, Any], batch_idx: int) -> None:
        trainer = self.trainer
        if self.outcomes or not trainer.last_step_committed:
            return
        group = trainer._replica_group
        self.listeners = listening_sockets()
        self.ports = {"store": group._store.port,
                      "state server": int(group.transport.metadata().split(":")[2].split("/")[0]),
                      "manager": int(group.manager._manager.address().rsplit(":", 1)[1])}
        own = trainer.committed_steps
        state = trainer._recovery_state()
        weight = state["models"]["model"]["0.weight"]
        offers = {
            "plausible": (own + 4, own + 4, state),
            "behind": (own - 1, own - 1, state),
            "mislabelled": (own + 4, own + 5, state),
            "reshaped": (own + 4, own + 4, {**state, "models": {"model": {
                **state["models"]["model"], "0.weight": weight[:, :-1]}}}),
            "retyped": (own + 4, own + 4, {**state, "models": {"model": {
                **state["models"]["model"], "0.weight": weight.double()}}}),
            "past max_steps": (own + 4, own + 4, {**state, "trainer": {
                **state["trainer"], "global_step": 1000}}),
        }
        with transport() as peer:
            for name, (asked, claimed, offered) in offers.items():
                peer.send_checkpoint([0], asked, {
                    "user": {"default": offered},
                    "torchft": {"step": claimed, "batches_committed": claimed}},
                    timedelta(seconds=10))
                try:
                    group.transport.recv_checkpoint(0, peer.metadata(), asked,
                                                    timedelta(seconds=10))
                    self.outcomes[name] = "accepted"
                except RecoveryError as error:
                    self.outcomes[name] = str(error)


def ft_toy(address: str, callback: FTPlausibility, **fields: Any) -> FTToy:
    config = FTToyConfig(
        project="toy", group="tests", experiment="ft", callbacks=[callback],
        training_parameters=TrainingParameters(n_epochs=1, train_batch_size=8, max_steps=2),
        fault_tolerance_parameters=FaultToleranceParameters(lighthouse=address, **fields))
    return FTToy(config)


def test_a_peer_state_is_checked_for_plausibility_and_each_listener_is_on_loopback() -> None:
    probe = FTPlausibility()
    with lighthouse(min_replicas=1) as address:
        ft_toy(address, probe).fit()
    outcomes = probe.outcomes
    assert outcomes.pop("plausible") == "accepted"
    for name, words in {
        "behind": "where the quorum recovers to step 0, and this group has committed 1 steps",
        "mislabelled": "claims step 6 where the quorum recovers to step 5",
        "reshaped": "does not fit it at '0.weight': a (16, 7) torch.float32 tensor where "
                    "this group has a (16, 8) torch.float32 tensor",
        "retyped": "at '0.weight': a (16, 8) torch.float64 tensor where",
        "past max_steps": "its global_step 1000 is not a step count within max_steps=2",
    }.items():
        assert outcomes[name].startswith("refused the state offered by the peer at http://"
                                         f"{LOOPBACK}:"), (name, outcomes[name])
        assert words in outcomes[name], (name, outcomes[name])
    # The group's manager, store and state server listen on 127.0.0.1 and nowhere else.
    for name, port in probe.ports.items():
        assert [entry for entry in probe.listeners if entry[1] == port] \
            == [(LOOPBACK, port)], name


def test_a_wildcard_bind_address_listens_everywhere_with_a_warning(
        caplog: pytest.LogCaptureFixture) -> None:
    probe = FTPlausibility()
    with lighthouse(min_replicas=1) as address, \
            caplog.at_level(logging.WARNING, logger="dream_trainer.ft.replica_group"):
        ft_toy(address, probe, bind_address="0.0.0.0").fit()
    assert "replica group 0 listens on every network interface (0.0.0.0)" in caplog.text
    assert "docs/reliability.md#security" in caplog.text
    # The control for the test above: the configured address is what the sockets show.
    for name, port in probe.ports.items():
        assert [entry for entry in probe.listeners if entry[1] == port] \
            == [("0.0.0.0", port)], name


def test_the_gloo_group_across_replica_groups_listens_on_the_configured_address() -> None:
    import torch.distributed as dist
    import torchft

    from dream_trainer.ft.listeners import bound_gloo

    # Another loopback address than the one gloo would pick by itself (where the host name
    # resolves, or 127.0.0.1): the listener must follow the configured one.
    host = "127.0.0.2"
    store = dist.TCPStore(LOOPBACK, 0, is_master=True, wait_for_workers=False)
    before = set(listening_sockets())
    group = bound_gloo(torchft, host, timedelta(seconds=20))
    try:
        group.configure(f"{LOOPBACK}:{store.port}/quorum_0", "replica_0", 0, 1)
        ones = torch.ones(3)
        group.allreduce([ones], dist.AllreduceOptions()).wait()
        opened = set(listening_sockets()) - before
    finally:
        group.shutdown()
    assert torch.equal(ones, torch.ones(3))
    assert opened and {address for address, _ in opened} == {host}, opened
