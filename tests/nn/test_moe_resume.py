"""Checkpoints of expert-parallel runs: SIGKILL and resume under ep=2 continue bit for bit, and
an ep=2 checkpoint resumes in one process (ep=1) and the reverse with exactly the saved state:
the keys do not depend on the expert-parallel degree (the experts are saved whole)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from tests.helpers.checkpointing import assert_same_weights as assert_same
from tests.helpers.launch import REPO, check, run_script, torchrun

pytestmark = pytest.mark.distributed

SCRIPT = REPO / "tests/scripts/moe_checkpoint.py"


def ep2(*args: str | Path) -> subprocess.CompletedProcess[str]:
    return torchrun(SCRIPT, [str(arg) for arg in args])


def one_process(*args: str | Path) -> subprocess.CompletedProcess[str]:
    return run_script(SCRIPT, 1, *args, timeout=300)


def test_ep2_resumes_bit_exact_and_across_expert_parallel_degrees(tmp_path: Path) -> None:
    markers = tmp_path / "markers"
    markers.mkdir()
    check(ep2(tmp_path / "straight", tmp_path / "straight", "--snapshot", "2"))
    # Killed after step 3: the newest checkpoint is step 2.
    killed = ep2(tmp_path / "killed", tmp_path / "killed", "--kill", "step:3", "--markers",
                 markers)
    assert killed.returncode != 0 and (markers / "step_3").exists()
    shutil.copytree(tmp_path / "killed", tmp_path / "to_one")  # the same checkpoint, for ep=1
    check(ep2(tmp_path / "killed", tmp_path / "resumed"))
    straight = {tag: torch.load(tmp_path / f"straight.{tag}") for tag in ("step2", "final")}
    assert straight["final"]["global_step"] == 4
    assert_same(torch.load(tmp_path / "resumed.loaded"), straight["step2"])
    assert_same(torch.load(tmp_path / "resumed.final"), straight["final"])
    # ep=2 -> one process: exactly the state ep=2 saved at step 2; it trains on to step 4.
    check(one_process(tmp_path / "to_one", tmp_path / "one"))
    assert_same(torch.load(tmp_path / "one.loaded"), straight["step2"])
    assert torch.load(tmp_path / "one.final")["global_step"] == 4
    # One process -> ep=2: a one-process checkpoint at step 2, resumed on 2 ranks.
    (tmp_path / "markers_one").mkdir()  # each kill happens once per marker directory
    killed = one_process(tmp_path / "from_one", tmp_path / "single", "--kill", "step:3",
                         "--markers", tmp_path / "markers_one", "--snapshot", "2")
    assert killed.returncode != 0
    check(ep2(tmp_path / "from_one", tmp_path / "back"))
    assert_same(torch.load(tmp_path / "back.loaded"), torch.load(tmp_path / "single.step2"))
    assert torch.load(tmp_path / "back.final")["global_step"] == 4
