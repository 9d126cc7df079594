"""HangWatchdog's files: a private default directory, and writes that never follow a symlink."""

from __future__ import annotations

import os
import stat
import tempfile
from pathlib import Path

import pytest

from dream_trainer.callbacks.hang_files import private_trace_dir, write_file
from dream_trainer.callbacks.hang_report import report_once, write_record
from dream_trainer.callbacks.hang_watchdog import HangWatchdog
from tests.helpers.toy import ToyTrainer, toy_config


@pytest.fixture
def temp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The system's temporary directory, as this process sees it, moved to a fresh one."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    return tmp_path


def test_the_default_directory_is_private_to_this_user(temp: Path) -> None:
    directory = private_trace_dir("toy", "tests", "run")
    base = temp / f"dream_trainer-{os.getuid()}"
    assert directory == base / "toy" / "tests" / "run" / "hang"
    info = os.lstat(base)
    assert stat.S_ISDIR(info.st_mode) and stat.S_IMODE(info.st_mode) == 0o700
    assert info.st_uid == os.getuid()
    # Every rank of the run names the same directory; a second call accepts the first's.
    assert private_trace_dir("toy", "tests", "run") == directory
    written = write_file(directory, "flight_recorder_0", b"dump")
    assert written.read_bytes() == b"dump"
    assert stat.S_IMODE(os.lstat(written).st_mode) == 0o600
    assert stat.S_IMODE(os.lstat(directory).st_mode) == 0o700
    # pre_fit resolves the default from the run's names.
    watchdog = HangWatchdog(timeout=60)
    assert watchdog.trace_dir is None
    ToyTrainer(toy_config(callbacks=[watchdog])).fit()
    assert watchdog.trace_dir == directory


def test_a_planted_default_directory_is_refused_naming_it_and_the_fix(
        temp: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    base = temp / f"dream_trainer-{os.getuid()}"
    elsewhere = temp / "attacker"
    elsewhere.mkdir(mode=0o700)
    base.symlink_to(elsewhere)
    watchdog = HangWatchdog(timeout=60)
    with pytest.raises(PermissionError, match=f"{base} is a symbolic link, so another user "
                                              "could redirect or read the hang records"):
        ToyTrainer(toy_config(callbacks=[watchdog])).fit()
    assert not watchdog.watching and list(elsewhere.iterdir()) == []

    base.unlink()
    base.write_text("")
    with pytest.raises(PermissionError, match="is not a directory"):
        private_trace_dir("toy", "tests", "run")

    base.unlink()
    base.mkdir(mode=0o700)
    base.chmod(0o777)
    with pytest.raises(PermissionError, match="has mode 777, which lets other users in.*remove "
                                              r"it .*HangWatchdog\(trace_dir=\.\.\.\)"):
        private_trace_dir("toy", "tests", "run")

    # Another user's directory (this user's, seen as another's).
    base.chmod(0o700)
    owner = os.getuid()
    monkeypatch.setattr(os, "getuid", lambda: owner + 1)
    (temp / f"dream_trainer-{owner + 1}").mkdir(mode=0o700)
    with pytest.raises(PermissionError, match=f"belongs to user id {owner}, not to this user"):
        private_trace_dir("toy", "tests", "run")


def test_planted_symlinks_in_the_trace_dir_are_replaced_not_written_through(
        tmp_path: Path) -> None:
    directory = tmp_path / "trace"
    directory.mkdir()
    victims = {name: tmp_path / f"victim_{name}" for name in
               ("hang_rank0.json", "flight_recorder_0", "hang_verdict.json")}
    for name, victim in victims.items():
        victim.write_text("precious")
        (directory / name).symlink_to(victim)
    # A guessable temporary name (an earlier version wrote hang_rank0.tmp, then renamed it).
    guessed = tmp_path / "victim_tmp"
    guessed.write_text("precious")
    (directory / "hang_rank0.tmp").symlink_to(guessed)

    write_record(directory, "r", 0, 1, step=3, epoch=0, stuck=5.0, mesh=None)
    write_file(directory, "flight_recorder_0", b"dump")
    emitted: list[str] = []
    assert report_once(directory, "r", 0, 1, wait=0.0, emit=emitted.append)

    assert [victim.read_text() for victim in [*victims.values(), guessed]] == ["precious"] * 4
    for name in victims:
        assert not (directory / name).is_symlink(), name
    assert (directory / "flight_recorder_0").read_bytes() == b"dump"
    assert '"global_step": 3' in (directory / "hang_rank0.json").read_text()
    assert len(emitted) == 1 and emitted[0].startswith("hang verdict over 1 of 1 ranks")
    # Nothing is left under a temporary name of its own.
    assert sorted(path.name for path in directory.iterdir()) == sorted([*victims,
                                                                        "hang_rank0.tmp"])
