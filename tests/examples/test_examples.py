"""The examples run end to end and learn what they claim to learn."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from tests.helpers.launch import REPO, check, child_env, torchrun

GAN = REPO / "examples/gan.py"
DIGITS = REPO / "examples/digits.py"


def generated_means(output: str) -> tuple[float, float]:
    match = re.search(r"generated mean: before=(-?[\d.]+) after=(-?[\d.]+)", output)
    assert match, output
    return float(match.group(1)), float(match.group(2))


@pytest.mark.distributed
def test_gan_trains_identically_under_ddp_and_fsdp() -> None:
    means = {}
    for parallel in ("ddp", "fsdp"):
        result = check(torchrun(GAN, ["--parallel", parallel, "--epochs", "16"]))
        means[parallel] = generated_means(result.stdout)
    before, after = means["ddp"]
    assert abs(before - 3.0) > 2.0 and abs(after - 3.0) < 0.5
    assert means["fsdp"] == means["ddp"]


def test_digits_reaches_90_percent_in_one_process() -> None:
    result = check(subprocess.run([sys.executable, str(DIGITS)], env=child_env(), cwd=REPO,
                                  capture_output=True, text=True, timeout=300))
    accuracy = float(re.search(r"val_accuracy=([\d.]+)", result.stdout).group(1))
    assert accuracy > 0.9


@pytest.mark.distributed
def test_digits_reaches_90_percent_on_two_ranks() -> None:
    result = check(torchrun(DIGITS))
    accuracies = re.findall(r"val_accuracy=([\d.]+)", result.stdout)
    assert len(accuracies) == 1, result.stdout  # printed by rank 0 only
    assert float(accuracies[0]) > 0.9
