"""The object-store run lock against moto's S3 server: two processes racing for one lock,
exactly one wins each time; an s3fs too old for conditional writes is refused at first use;
a store that ignores the condition is found out; teardown never fails on the client."""

from __future__ import annotations

import json
import logging
import multiprocessing
import time
from collections.abc import Iterator
from dataclasses import asdict, replace
from typing import Any

import pytest

from dream_trainer.checkpoint import CheckpointError
from dream_trainer.checkpoint.lock import LockHolder
from dream_trainer.checkpoint.object_store import (S3FS_CONDITIONAL_CREATE, ObjectLock,
                                                   ObjectStorage, _storage, object_storage)
from dream_trainer.checkpoint.storage import ObjectPath, location, storage_for
from tests.helpers.s3 import S3Server, lock_contender

TRIALS = 300


@pytest.fixture
def fresh_clients() -> Iterator[None]:
    """No storage cached from before (or made during) a test that changes what s3fs reports."""
    _storage.cache_clear()
    yield
    _storage.cache_clear()


def s3_storage(url: str) -> ObjectStorage:
    storage = storage_for(location(url))
    assert isinstance(storage, ObjectStorage)
    return storage


def test_two_processes_racing_for_one_lock_one_wins_every_time(s3: S3Server,
                                                               s3_url: str) -> None:
    # Two long-lived processes (spawned: forking would copy moto's threads and s3fs's event
    # loop), each with its own client, start every trial together at a barrier, as two runs
    # of one experiment launched at once would.
    context = multiprocessing.get_context("spawn")
    tasks = [context.Queue(), context.Queue()]
    results = context.Queue()
    barrier = context.Barrier(2)
    workers = [context.Process(target=lock_contender, args=(queue, results, barrier))
               for queue in tasks]
    for worker in workers:
        worker.start()
    wins = {worker.pid: 0 for worker in workers}
    try:
        started = time.perf_counter()
        for trial in range(TRIALS):
            root = f"{s3_url}/trial_{trial}"
            for queue in tasks:
                queue.put(root)
            outcomes = dict(results.get(timeout=60) for _ in workers)
            held = [pid for pid, outcome in outcomes.items() if outcome == "held"]
            assert len(held) == 1, (trial, outcomes)
            (winner,), (loser,) = held, set(outcomes) - set(held)
            wins[winner] += 1
            assert outcomes[loser].startswith(
                f"another run holds the lock on {root}: pid {winner} on host"), outcomes
        elapsed = time.perf_counter() - started
    finally:
        for queue in tasks:
            queue.put(None)
        for worker in workers:
            worker.join(timeout=60)
    assert [worker.exitcode for worker in workers] == [0, 0]
    assert sum(wins.values()) == TRIALS
    # Every winner released its lock at the end of its trial: nothing is left.
    assert s3.keys(s3_url.split("/", 3)[3]) == []
    logging.getLogger(__name__).info("%d lock races in %.1f s, wins per process %s", TRIALS,
                                     elapsed, sorted(wins.values()))


@pytest.mark.parametrize("version", ["2024.10.0", "0.4.2", "2024.6.1"])
def test_an_s3fs_without_conditional_writes_is_refused_at_first_use(
        s3: S3Server, s3_url: str, version: str, monkeypatch: pytest.MonkeyPatch,
        fresh_clients: None) -> None:
    import s3fs

    monkeypatch.setattr(s3fs, "__version__", version)
    with pytest.raises(CheckpointError) as error:
        object_storage(ObjectPath(s3_url))
    assert str(error.value) == (
        f"s3fs {version} is installed, but s3:// URLs need s3fs>={S3FS_CONDITIONAL_CREATE}: "
        "an older s3fs writes the run lock object unconditionally (no If-None-Match: *), so "
        "two runs of one experiment could both hold it and delete each other's checkpoints. "
        "Fix: pip install 's3fs>=2024.12' (or pip install 'dream-trainer[s3]')")
    # Each use checks again until the fix: nothing is cached from the refused one.
    with pytest.raises(CheckpointError, match=f"s3fs {version} is installed"):
        storage_for(location(f"{s3_url}/other"))
    for accepted in ("2024.12.0", "2025.7.0.dev3+g1234"):
        monkeypatch.setattr(s3fs, "__version__", accepted)
        _storage.cache_clear()
        assert isinstance(object_storage(ObjectPath(s3_url)), ObjectStorage)
    monkeypatch.delattr(s3fs, "__version__")
    _storage.cache_clear()
    with pytest.raises(CheckpointError, match="s3fs of unknown version is installed"):
        object_storage(ObjectPath(s3_url))


class IgnoresCondition:
    """An S3 client or server that ignores ``If-None-Match`` (s3fs before 2024.12 dropped
    or rejected ``mode``): every conditional create overwrites."""

    def __init__(self, fs: Any) -> None:
        self.fs = fs

    def pipe_file(self, url: str, data: bytes, mode: str = "overwrite") -> None:
        self.fs.pipe_file(url, data)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.fs, name)


def test_a_store_that_ignores_the_condition_is_refused(s3: S3Server, s3_url: str) -> None:
    real = s3_storage(s3_url)
    broken = ObjectStorage(IgnoresCondition(real.fs))
    root = ObjectPath(s3_url)
    first, second = ObjectLock(broken, root), ObjectLock(broken, root)
    for lock in (first, second):
        with pytest.raises(CheckpointError) as error:
            lock.acquire()
        assert str(error.value) == (
            f"the object store created {root}/.lock twice: it ignores the condition "
            "If-None-Match: *, so the run lock cannot keep two runs apart there. Use a store "
            "that honours conditional writes (AWS S3 does) or a local path for checkpoints, "
            f"and delete {root}/.lock")
        assert not lock.held
    # With conditional writes, the same sequence: the first holds it, the second (a run on
    # another machine) is refused.
    real.fs.rm_file(f"{root}/.lock")
    held, other = ObjectLock(real, root), ObjectLock(real, root)
    other.holder = replace(other.holder, host="other-host", boot_id="another-boot")
    held.acquire()
    with pytest.raises(CheckpointError, match="another run holds the lock"):
        other.acquire()
    held.release()
    assert s3.keys(s3_url.split("/", 3)[3]) == []


class WritesApart:
    """A store whose condition check and write are apart (moto's server under load): the
    first conditional create is accepted, then another run's accepted create lands over it."""

    def __init__(self, fs: Any, other: bytes) -> None:
        self.fs, self.other, self.created = fs, other, False

    def pipe_file(self, url: str, data: bytes, mode: str = "overwrite") -> None:
        if not self.created:
            self.created = True
            self.fs.pipe_file(url, data, mode=mode)
            self.fs.pipe_file(url, self.other)
            return
        self.fs.pipe_file(url, data, mode=mode)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.fs, name)


def test_a_create_the_store_also_gave_another_run_names_that_run(s3: S3Server,
                                                                 s3_url: str) -> None:
    real = s3_storage(s3_url)
    root = ObjectPath(s3_url)
    winner = replace(LockHolder.this_process(), host="other-host", boot_id="another-boot")
    lock = ObjectLock(ObjectStorage(WritesApart(real.fs, json.dumps(asdict(winner)).encode())),
                      root)
    with pytest.raises(CheckpointError) as error:
        lock.acquire()
    message = str(error.value)
    assert message.startswith(f"another run holds the lock on {root}: {winner.describe()} ("), \
        message
    assert ("; it replaced this run's record right after the store accepted both as new, so "
            "the store's conditional writes are not atomic. Two runs writing") in message
    assert not lock.held
    # The other run's record is left as it was: it holds the lock.
    assert LockHolder.parse(real.read_bytes(root / ".lock").decode()) == winner
    real.fs.rm_file(f"{root}/.lock")


def test_a_scheme_without_a_checked_conditional_create_is_not_locked(
        fresh_clients: None) -> None:
    # fsspec's memory filesystem stands for any non-S3 store (gcs, azure...): its "create"
    # is not known to be atomic across processes, so no run takes a lock there.
    root = ObjectPath("memory://store/runs")
    storage = object_storage(root)
    expected = (f"the run lock at {root} needs a create-if-absent that the store makes "
                "atomic, which dream_trainer has checked only for S3 (s3fs's conditional "
                "PUT), not for fsspec's memory filesystem")
    with pytest.raises(CheckpointError) as error:
        storage.lock(root).acquire()
    assert str(error.value).startswith(expected)
    assert "Write checkpoints under an s3:// URL" in str(error.value)
    # Found by the check before the models are built, too; reading needs no lock.
    problem = storage.access_problem(root, probe=".probe")
    assert problem is not None and problem.startswith(expected)
    assert storage.access_problem(root) is None


def ours(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [record.getMessage() for record in caplog.records
            if record.name.startswith("dream_trainer")]


class NoDelete:
    """A client without deletes (s3fs 0.4.2 beside boto3 1.44 raised this at teardown)."""

    def __init__(self, fs: Any) -> None:
        self.fs = fs

    def rm_file(self, url: str) -> None:
        raise NotImplementedError

    def __getattr__(self, name: str) -> Any:
        return getattr(self.fs, name)


def test_release_never_fails_on_the_client(s3: S3Server, s3_url: str,
                                           caplog: pytest.LogCaptureFixture) -> None:
    storage = ObjectStorage(NoDelete(s3_storage(s3_url).fs))
    root = ObjectPath(s3_url)
    prefix = s3_url.split("/", 3)[3]
    lock = ObjectLock(storage, root)
    lock.acquire()
    with caplog.at_level(logging.WARNING, logger="dream_trainer"):
        lock.release()  # does not raise
    assert not lock.held
    assert ours(caplog) == [
        f"could not delete {root}/.lock, so it is left in the store: delete it before this "
        f"experiment runs again from another machine (NotImplementedError)"]
    assert s3.keys(prefix) == [f"{prefix}/.lock"]
    # The take-over marker likewise: a dead holder's lock is taken over, and the marker
    # the client cannot delete is named, not raised.
    dead = replace(LockHolder.this_process(), pid=2**22 + 1, launcher_pid=1)
    storage.write_bytes(root / ".lock", json.dumps(asdict(dead)).encode())
    caplog.clear()
    taken = ObjectLock(storage, root)
    with caplog.at_level(logging.WARNING, logger="dream_trainer"):
        taken.acquire()
    assert taken.held
    assert LockHolder.parse(storage.read_bytes(root / ".lock").decode()) == taken.holder
    assert ours(caplog)[-1] == (
        f"could not delete {root}/.lock.takeover, so it is left in the store: delete it "
        f"before this experiment runs again from another machine (NotImplementedError)")
    assert s3.keys(prefix) == [f"{prefix}/.lock", f"{prefix}/.lock.takeover"]
