"""examples/word_lm.py: hidden state carried across batches survives SIGKILL, bit-exactly."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import torch

from tests.helpers.launch import REPO, run_script

SCRIPT = REPO / "tests/scripts/word_lm_run.py"


def run(nproc: int, *args: str | Path) -> subprocess.CompletedProcess[str]:
    return run_script(SCRIPT, nproc, *args)


def assert_equal(actual: object, expected: object, where: str = "") -> None:
    if isinstance(expected, torch.Tensor):
        assert isinstance(actual, torch.Tensor) and torch.equal(actual, expected), where
    elif isinstance(expected, dict):
        assert isinstance(actual, dict) and actual.keys() == expected.keys(), where
        for key in expected:
            assert_equal(actual[key], expected[key], f"{where}.{key}")
    elif isinstance(expected, (list, tuple)):
        assert isinstance(actual, (list, tuple)) and len(actual) == len(expected), where
        for index, (a, e) in enumerate(zip(actual, expected)):
            assert_equal(a, e, f"{where}[{index}]")
    else:
        assert actual == expected, where


@pytest.mark.distributed
@pytest.mark.parametrize("nproc", [1, 2])
def test_sigkill_mid_epoch_then_resume_is_bit_exact(nproc: int, tmp_path: Path) -> None:
    whole = run(nproc, tmp_path / "whole", tmp_path / "whole.pt")
    assert whole.returncode == 0, whole.stderr[-3000:]
    (tmp_path / "markers").mkdir()
    # Killed after step 7: the newest checkpoint is step 4, inside epoch 0, so the resumed
    # run continues the epoch with the hidden state that step 4 left on each rank.
    killed = run(nproc, tmp_path / "split", tmp_path / "split.pt", "--kill", "step:7",
                 "--markers", tmp_path / "markers")
    assert killed.returncode != 0
    resumed = run(nproc, tmp_path / "split", tmp_path / "split.pt")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    expected, actual = torch.load(tmp_path / "whole.pt"), torch.load(tmp_path / "split.pt")
    assert expected["global_step"] == actual["global_step"] == 20
    assert len(expected["hidden"]) == nproc
    if nproc == 2:  # each rank carries other streams: a swap would show
        assert not torch.equal(expected["hidden"][0][0], expected["hidden"][1][0])
    assert_equal(actual, expected)
