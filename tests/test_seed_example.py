"""The user's own Complete Example (seed 004) runs, alone and under torchrun with 2 ranks."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.helpers.launch import REPO, check, child_env, torchrun

SCRIPT = REPO / "tests/scripts/seed_example.py"


def test_seed_example_single_process() -> None:
    result = check(subprocess.run([sys.executable, str(SCRIPT)], env=child_env(), cwd=REPO,
                                  capture_output=True, text=True, timeout=180))
    # 512 samples / batch 32 = 16 micro-batches = 4 optimizer steps per epoch.
    assert "rank=0 epochs=2 steps=8 batches=32" in result.stdout


@pytest.mark.distributed
def test_seed_example_two_ranks() -> None:
    result = check(torchrun(SCRIPT))
    # Each rank reads half the data: 8 micro-batches = 2 optimizer steps per epoch.
    for rank in (0, 1):
        assert f"rank={rank} epochs=2 steps=4 batches=16" in result.stdout
