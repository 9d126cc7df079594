"""One run per experiment directory (a lock naming its holder), and checkpointing switched
off altogether."""

from __future__ import annotations

import dataclasses
import json
import logging
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import ValidationError

from dream_trainer.checkpoint import CheckpointError
from dream_trainer.checkpoint.lock import LockHolder
from dream_trainer.configs import CheckpointParameters, apply_cli_overrides
from tests.helpers.checkpointing import CheckpointedTrainer, checkpointed_config
from tests.helpers.launch import REPO, child_env

LOCK = "ckpt/tests/run/checkpoints/.lock"


def test_a_second_run_is_refused_while_the_first_runs_and_takes_over_once_it_is_dead(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    first = subprocess.Popen([sys.executable, str(REPO / "tests/scripts/locking_run.py"),
                              str(tmp_path)], env=child_env(), cwd=REPO,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        assert first.stdout is not None
        for line in first.stdout:
            if "LOCKED" in line:
                break
        holder = json.loads((tmp_path / LOCK).read_text())
        assert holder["pid"] == first.pid and holder["host"] and holder["started"]
        second = CheckpointedTrainer(checkpointed_config(tmp_path, resume="latest"))
        with pytest.raises(CheckpointError, match=rf"another run holds the lock on .*: pid "
                                                  rf"{first.pid} on host {holder['host']}, "
                                                  rf"started {re.escape(holder['started'])}"):
            second.fit()
        assert json.loads((tmp_path / LOCK).read_text())["pid"] == first.pid  # untouched
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait(timeout=60)
    caplog.set_level(logging.WARNING, logger="dream_trainer")
    third = CheckpointedTrainer(checkpointed_config(tmp_path, resume="latest"))
    third.fit()
    assert f"taking over the lock on {tmp_path / LOCK[:-6]} from a run that is no longer " \
           f"running (pid {first.pid}" in caplog.text
    assert third.global_step == 30
    assert not (tmp_path / LOCK).exists()  # released when fit() ended


def test_a_lock_of_a_dead_earlier_worker_of_the_same_launcher_is_taken_silently(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    lock = tmp_path / LOCK
    lock.parent.mkdir(parents=True)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    # This process's record but for the pid: the same launcher (our parent) started both.
    earlier = dataclasses.replace(LockHolder.this_process(), pid=int(dead.stdout),
                                  started="earlier", process_start=None)
    lock.write_text(json.dumps(dataclasses.asdict(earlier)))
    caplog.set_level(logging.INFO, logger="dream_trainer")
    CheckpointedTrainer(checkpointed_config(tmp_path, resume="latest")).fit()
    assert "taking over the lock of an earlier worker of this run" in caplog.text
    assert "no longer running" not in caplog.text


def test_disabled_checkpointing_writes_nothing_and_cannot_resume(tmp_path: Path) -> None:
    config = checkpointed_config(tmp_path, resume=None, enabled=False)
    trainer = CheckpointedTrainer(config)
    trainer.fit()
    assert trainer.global_step == 30
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(CheckpointError, match="checkpointing disabled"):
        trainer.save_checkpoint()
    with pytest.raises(ValidationError, match="resume='latest' needs checkpoints, but "
                                              "enabled=False"):
        CheckpointParameters(enabled=False, resume="latest")
    switched = apply_cli_overrides(checkpointed_config(tmp_path, resume=None),
                                   ["--checkpoint_parameters.enabled", "false"])
    assert switched.checkpoint_parameters.enabled is False
