"""The run lock itself: simultaneous takeovers, holders this process cannot check (another PID
namespace, another kernel), malformed records, release, and forked children.

"Without OS locks" tests make ``flock`` fail as on a filesystem that has none, so that the
record and the takeover marker decide alone.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import logging
import os
import signal
import subprocess
import sys
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from dream_trainer.checkpoint import CheckpointError
from dream_trainer.checkpoint import lock as run_lock
from dream_trainer.checkpoint.lock import LOCK, TAKEOVER, LockHolder, RunLock
from tests.helpers.launch import REPO, child_env

OTHER_NAMESPACE = "pid:[1]"  # no namespace has inode 1

Holding = Callable[[Path, str], "subprocess.Popen[str]"]


def dead_pid() -> int:
    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    return int(done.stdout)


def record(**changes: object) -> LockHolder:
    """A holder on this machine, as another run (another launcher) would write it."""
    return dataclasses.replace(LockHolder.this_process(), launcher_pid=1, **changes)


def write(directory: Path, holder: LockHolder | str) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    text = holder if isinstance(holder, str) else json.dumps(dataclasses.asdict(holder))
    (directory / LOCK).write_text(text)
    return directory / LOCK


@pytest.fixture(params=["os locks", "without os locks"])
def os_locks(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> bool:
    if request.param == "without os locks":
        def no_locks(descriptor: int, operation: int) -> None:
            raise OSError(errno.ENOLCK, "No locks available")

        monkeypatch.setattr(run_lock.fcntl, "flock", no_locks)
    return request.param == "os locks"


@pytest.fixture
def holding() -> Iterator[Holding]:
    """Starts a process that holds the OS lock on a lock file and writes a given record."""
    started: list[subprocess.Popen[str]] = []

    def start(path: Path, text: str) -> subprocess.Popen[str]:
        code = ("import fcntl, os, sys; path, text = sys.argv[1:]; "
                "d = os.open(path, os.O_RDWR | os.O_CREAT); fcntl.flock(d, fcntl.LOCK_EX); "
                "os.write(d, text.encode()); print('held', flush=True); sys.stdin.read()")
        path.parent.mkdir(parents=True, exist_ok=True)
        process = subprocess.Popen([sys.executable, "-c", code, str(path), text],
                                   stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        started.append(process)
        assert process.stdout is not None and process.stdout.readline() == "held\n"
        return process

    yield start
    for process in started:
        process.kill()
        process.wait(timeout=30)


@pytest.mark.parametrize("flag", ["", "--no-os-locks"])
def test_300_simultaneous_takeovers_of_a_dead_lock_have_exactly_one_winner(
        tmp_path: Path, flag: str) -> None:
    # The lock before the OS lock let two or three contenders win in 4 to 49 of 300 trials.
    trials, contenders = 300, 8
    done = subprocess.run([sys.executable, str(REPO / "tests/scripts/lock_race.py"),
                           str(tmp_path), str(trials), str(contenders), *([flag] if flag else [])],
                          env=child_env(), cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    outcome = json.loads(done.stdout)
    assert Counter(outcome["winners"]) == Counter({1: trials})
    assert outcome["impostors"] == 0  # each winner found the file naming it
    losers = outcome["losers"]
    assert sum(losers.values()) == trials * (contenders - 1)
    allowed = {"another run holds the lock"} | (
        {"another run is taking over the lock"} if flag else set())
    assert set(losers) <= allowed, losers
    assert outcome["left"] == [] and outcome["exit_codes"] == [0] * contenders


def test_a_dead_holder_in_this_namespace_is_taken_over_with_a_warning(
        tmp_path: Path, os_locks: bool, caplog: pytest.LogCaptureFixture) -> None:
    dead = record(pid=dead_pid())
    path = write(tmp_path, dead)
    lock = RunLock(tmp_path)
    with caplog.at_level(logging.WARNING, logger="dream_trainer"):
        lock.acquire()
    assert f"taking over the lock on {tmp_path} from a run that is no longer running " \
           f"({dead.describe()})" in caplog.text
    assert LockHolder.parse(path.read_text()) == lock.holder
    assert not (tmp_path / TAKEOVER).exists()
    lock.release()
    assert not path.exists()


def test_a_live_holder_in_another_pid_namespace_is_not_taken_over(
        tmp_path: Path, holding: Holding, monkeypatch: pytest.MonkeyPatch) -> None:
    # Its pid means nothing here (here, it is a dead process's), but it holds the OS lock,
    # which every process on this kernel sees whatever its namespace.
    monkeypatch.setattr(run_lock, "_RECORD_WAIT_S", 0.2)
    pid = dead_pid()
    for namespace, note in [(OTHER_NAMESPACE, ""),
                            (None, " (it is no longer running, but a process it started still "
                                   "holds the file's OS lock)")]:
        other = record(pid=pid, pid_namespace=namespace or LockHolder.this_process()
                       .pid_namespace)
        text = json.dumps(dataclasses.asdict(other))
        holder = holding(tmp_path / LOCK, text)
        with pytest.raises(CheckpointError) as refused:
            RunLock(tmp_path).acquire()
        assert f"another run holds the lock on {tmp_path}: {other.describe()}{note}. Two " \
               "runs writing one experiment's checkpoints" in str(refused.value)
        assert f"or remove {tmp_path / LOCK} if that run is gone" in str(refused.value)
        assert (tmp_path / LOCK).read_text() == text
        holder.kill()
        holder.wait(timeout=30)
        (tmp_path / LOCK).unlink()


def test_without_os_locks_a_holder_in_another_pid_namespace_is_refused_live_or_not(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def no_locks(descriptor: int, operation: int) -> None:
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(run_lock.fcntl, "flock", no_locks)
    for pid in (os.getpid(), dead_pid()):
        other = record(pid=pid, pid_namespace=OTHER_NAMESPACE)
        path = write(tmp_path, other)
        with pytest.raises(CheckpointError, match=(
                rf"another run holds the lock on {tmp_path}: pid {pid} on host .* \(in another "
                r"PID namespace \(another container\) on this machine, so whether it still "
                r"runs cannot be checked from here\)")):
            RunLock(tmp_path).acquire()
        assert LockHolder.parse(path.read_text()) == other


def test_a_free_lock_of_another_namespace_on_this_kernel_is_taken_over(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    # A live process on this kernel would hold the OS lock: a free one means its holder died.
    other = record(pid=os.getpid(), pid_namespace=OTHER_NAMESPACE)
    write(tmp_path, other)
    lock = RunLock(tmp_path)
    with caplog.at_level(logging.WARNING, logger="dream_trainer"):
        lock.acquire()
    assert f"from a run that is no longer running ({other.describe()})" in caplog.text
    lock.release()


def test_a_holder_on_another_kernel_is_refused_even_with_the_os_lock_free(
        tmp_path: Path, os_locks: bool) -> None:
    # The filesystem may not share locks between machines (NFS without lockd).
    for other, where in [(record(boot_id="another-boot"),
                          "on another kernel with this host name (another machine, or this "
                          "one before a restart)"),
                         (record(host="elsewhere", boot_id="another-boot"), "on another host")]:
        path = write(tmp_path, other)
        with pytest.raises(CheckpointError) as refused:
            RunLock(tmp_path).acquire()
        assert f": {other.describe()} ({where}, so whether it still runs cannot be checked " \
               "from here)" in str(refused.value)
        assert LockHolder.parse(path.read_text()) == other


@pytest.mark.parametrize("text, problem", [
    ('{"host": "h", "pid": "abc", "started": "s", "process_start": null, '
     '"launcher_pid": 1}', "field 'pid' is 'abc', not of type int"),
    ('{"host": "h", "pid": 5}', "field 'started' is missing"),
    ('["h", 5]', "expected a JSON object, found list"),
    ("not json", "Expecting value: line 1 column 1"),
])
def test_a_malformed_record_gives_a_message_naming_the_file(
        tmp_path: Path, os_locks: bool, text: str, problem: str,
        caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(run_lock, "_RECORD_WAIT_S", 0.2)  # read again while unreadable
    path = write(tmp_path, text)
    lock = RunLock(tmp_path)
    if os_locks:  # no process holds it: a warning, and the lock is this run's
        with caplog.at_level(logging.WARNING, logger="dream_trainer"):
            lock.acquire()
        assert f"taking over the lock on {tmp_path}, whose record {path} is unreadable " \
               f"({problem}" in caplog.text
        assert LockHolder.parse(path.read_text()) == lock.holder
        lock.release()
        return
    with pytest.raises(CheckpointError) as refused:
        lock.acquire()
    assert str(refused.value).startswith(f"the lock file {path} is unreadable ({problem}")
    assert str(refused.value).endswith(", and this filesystem has no file locks to tell "
                                       "whether a run holds it: remove it once no run writes "
                                       f"to {tmp_path}")
    assert path.read_text() == text


def test_a_malformed_record_of_a_held_lock_is_refused_naming_the_file(
        tmp_path: Path, holding: Holding, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(run_lock, "_RECORD_WAIT_S", 0.2)
    holding(tmp_path / LOCK, '{"pid": "abc"}')
    with pytest.raises(CheckpointError, match=(
            rf"another run holds the lock on {tmp_path}: the lock file {tmp_path / LOCK} is "
            r"unreadable \(field 'host' is missing\)\. Two runs")):
        RunLock(tmp_path).acquire()


def test_release_leaves_a_lock_another_run_holds_now(tmp_path: Path, os_locks: bool) -> None:
    first = RunLock(tmp_path)
    first.acquire()
    if os_locks:  # the user removed the file, and another run created its own
        (tmp_path / LOCK).unlink()
        second = RunLock(tmp_path)
        second.acquire()
    else:  # the record names another run
        second = RunLock(tmp_path)
        second.holder = record(pid=os.getpid() + 1)
        write(tmp_path, second.holder)
    first.release()
    assert LockHolder.parse((tmp_path / LOCK).read_text()) == second.holder
    if os_locks:
        with pytest.raises(CheckpointError, match="another run holds the lock"):
            RunLock(tmp_path).acquire()
        second.release()
        assert not (tmp_path / LOCK).exists()


def test_a_forked_child_does_not_keep_the_lock_of_a_dead_run(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    # A DataLoader worker outlives a run killed with SIGKILL by up to seconds; it shares the
    # lock file's descriptor, which must not keep the OS lock held.
    code = """if True:
        import os, signal, sys, time
        from pathlib import Path
        from dream_trainer.checkpoint.lock import RunLock
        RunLock(Path(sys.argv[1])).acquire()
        child = os.fork()
        if child == 0:
            for stream in (1, 2):  # the test reads both to their end
                os.dup2(os.open(os.devnull, os.O_WRONLY), stream)
            time.sleep(60)
            os._exit(0)
        print(child, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    """
    run = subprocess.run([sys.executable, "-c", code, str(tmp_path)], env=child_env(),
                         cwd=REPO, capture_output=True, text=True, timeout=120)
    child = int(run.stdout)
    try:
        os.kill(child, 0)  # still running
        lock = RunLock(tmp_path)
        with caplog.at_level(logging.WARNING, logger="dream_trainer"):
            lock.acquire()
        assert "from a run that is no longer running" in caplog.text
        lock.release()
    finally:
        os.kill(child, signal.SIGKILL)  # an orphan: init reaps it
