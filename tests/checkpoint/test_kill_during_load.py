"""SIGKILL while a resharded checkpoint loads, then the same command again: the run continues
as if never interrupted, and the checkpoint is untouched (issue 26)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from dream_trainer.checkpoint.directory import checksum, complete_checkpoints, verify_files
from dream_trainer.checkpoint.trust import safe_reader
from tests.helpers.checkpointing import assert_same_state
from tests.helpers.launch import REPO, check, run_script

pytestmark = pytest.mark.distributed

CHECKPOINT_RUN = REPO / "tests/scripts/checkpoint_run.py"
KILL_DURING_LOAD = REPO / "tests/scripts/kill_during_load.py"
# 2 ranks make 5 optimizer steps per epoch and save at steps 4, 5 (end of epoch 0) and 8.
SAVED = [4, 5, 8]


def files_of_checkpoints(checkpoints: Path) -> dict[str, str]:
    """SHA-256 of every file inside the step directories (the run lock beside them is
    rewritten by every run)."""
    return {str(file.relative_to(checkpoints)): checksum(file)
            for file in sorted(checkpoints.glob("step_*/**/*")) if file.is_file()}


def test_sigkill_while_loading_on_another_layout_then_rerun_continues_exactly(
        tmp_path: Path) -> None:
    (tmp_path / "markers").mkdir()
    root, reference_root = tmp_path / "run", tmp_path / "reference"
    checkpoints = root / "ckpt/tests/run/checkpoints"
    # Per-rank state cannot follow a change in the number of processes.
    saved = run_script(CHECKPOINT_RUN, 2, root, tmp_path / "unused.pt", "--parallel", "fsdp",
                       "--kill", "step:9", "--markers", tmp_path / "markers", "--no-rank-state")
    assert saved.returncode != 0 and (tmp_path / "markers/step_9").exists(), saved.stderr[-3000:]
    assert [info.step for info in complete_checkpoints(checkpoints)] == SAVED
    before = files_of_checkpoints(checkpoints)

    # The reference: the same resume, on one process, from a copy, never interrupted. One
    # process keeps the global batch of 2 ranks with twice the accumulation.
    shutil.copytree(root, reference_root)
    samples = tmp_path / "reference.jsonl"
    check(run_script(CHECKPOINT_RUN, 1, reference_root, tmp_path / "reference.pt",
                     "--no-rank-state", "--accumulation", "4", "--samples", samples))
    first = json.loads(samples.read_text().splitlines()[0])
    assert first["epoch"] == 1  # it resumed at step 8, in epoch 1 (a fresh run starts in 0)

    marker = tmp_path / "loading"
    command = [marker, root, tmp_path / "final.pt", "--no-rank-state", "--accumulation", "4"]
    killed = run_script(KILL_DURING_LOAD, 1, *command)
    assert killed.returncode == -9, killed.stderr[-3000:]
    read, _, total = marker.read_text().partition(" of ")
    assert 0 < int(read) < int(total)  # it died with part of the state loaded
    # Loading wrote nothing: no file of any checkpoint changed, and none was added.
    assert files_of_checkpoints(checkpoints) == before
    assert [info.step for info in complete_checkpoints(checkpoints)] == SAVED
    latest = checkpoints / f"step_{SAVED[-1]}"
    verify_files(latest, safe_reader(str(latest)).read_metadata())

    check(run_script(KILL_DURING_LOAD, 1, *command))
    assert_same_state(torch.load(tmp_path / "final.pt"), torch.load(tmp_path / "reference.pt"))
    after = files_of_checkpoints(checkpoints)
    assert {name: after[name] for name in before} == before
