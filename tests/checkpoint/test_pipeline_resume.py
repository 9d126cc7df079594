"""Checkpoints of pipeline runs: SIGKILL and resume bit-exact, and resume across topologies.

The toy (Sequential of Linear, Tanh, Dropout, Linear) is split into 2 stages; 80 samples in
batches of 4 with 2 accumulated make 10 optimizer steps per epoch on any of these layouts
(a pipeline has one data-parallel rank); checkpoints every 4 steps. EMA and NanGuard run along.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.helpers.checkpointing import assert_same_state
from tests.helpers.launch import REPO, run_script

pytestmark = pytest.mark.distributed

SCRIPT = REPO / "tests/scripts/pipeline_checkpoint.py"


def run(pp: int, *args: str | Path) -> subprocess.CompletedProcess[str]:
    return run_script(SCRIPT, pp, *args, "--pp", str(pp))


def states(prefix: Path | str, ranks: int) -> list[dict[str, Any]]:
    return [torch.load(f"{prefix}.rank{rank}") for rank in range(ranks)]


def test_sigkill_mid_epoch_then_resume_is_bit_exact(tmp_path: Path) -> None:
    result = run(2, tmp_path / "straight", tmp_path / "straight.pt")
    assert result.returncode == 0, result.stderr[-3000:]
    (tmp_path / "markers").mkdir()
    kills = ["step:13"]  # mid-epoch, in the second epoch: resumes from step 12
    args = [tmp_path / "killed", tmp_path / "killed.pt", "--markers", tmp_path / "markers",
            "--kill", *kills]
    returncodes = [run(2, *args).returncode for _ in range(len(kills) + 1)]
    assert all(code != 0 for code in returncodes[:-1]) and returncodes[-1] == 0
    assert sorted(p.name for p in (tmp_path / "markers").iterdir()) == ["step_13"]
    for straight, resumed in zip(states(tmp_path / "straight.pt", 2),
                                 states(tmp_path / "killed.pt", 2), strict=True):
        assert straight["global_step"] == 20
        assert_same_state(resumed, straight)
        assert straight["ema"].keys() == resumed["ema"].keys() and straight["ema"]
        for key, average in straight["ema"].items():
            assert torch.equal(resumed["ema"][key], average), key
    # Each rank holds one stage: its own parameters, under the model's names.
    first, last = states(tmp_path / "straight.pt", 2)
    assert sorted(first["weights"]) == ["0.bias", "0.weight"]
    assert sorted(last["weights"]) == ["3.bias", "3.weight"]


def merged(prefix: Path, ranks: int) -> dict[str, Any]:
    """One snapshot from every rank's part (see pipeline_checkpoint.py's Snapshot)."""
    whole: dict[str, Any] = {"weights": {}, "optimizer": {}}
    for part in states(prefix, ranks):
        whole["weights"].update(part["weights"])
        whole["optimizer"].update(part["optimizer"])
        whole["lr"] = part["lr"]
    return whole


def assert_same_snapshot(actual: dict[str, Any], expected: dict[str, Any]) -> None:
    assert actual["lr"] == expected["lr"]
    assert actual["weights"].keys() == expected["weights"].keys() == {
        "0.weight", "0.bias", "3.weight", "3.bias"}
    for name, tensor in expected["weights"].items():
        assert torch.equal(actual["weights"][name], tensor), name
    assert actual["optimizer"].keys() == expected["optimizer"].keys()
    for name, state in expected["optimizer"].items():
        assert state.keys() == actual["optimizer"][name].keys() == {"step", "exp_avg",
                                                                   "exp_avg_sq"}
        for key, tensor in state.items():
            assert torch.equal(actual["optimizer"][name][key], tensor), (name, key)


def sample_ids(log: Path, epoch: int, before_batch: int | None = None) -> list[int]:
    ids = []
    for line in log.read_text().splitlines():
        record = json.loads(line)
        # Every stage reads the same batch; rank 0's record stands for the pipeline.
        if record["rank"] == 0 and record["epoch"] == epoch and (
                before_batch is None or record["batch_idx"] < before_batch):
            ids.extend(record["ids"])
    return ids


def test_resume_from_one_process_to_a_pipeline_and_back(tmp_path: Path) -> None:
    (tmp_path / "markers").mkdir()
    common = [tmp_path / "run", tmp_path / "final.pt", "--markers", tmp_path / "markers"]
    # One process, killed after step 6: its checkpoint is step 4 (8 micro-batches).
    first = run(1, *common, "--kill", "step:6", "--samples", tmp_path / "one.jsonl",
                "--snapshot", tmp_path / "one", "--snapshot-step", "4")
    assert first.returncode != 0
    # A 2-stage pipeline resumes it, killed after step 13: checkpoint 12 = 2 steps (4
    # micro-batches) into epoch 1.
    second = run(2, *common, "--kill", "step:13", "--samples", tmp_path / "two.jsonl",
                 "--snapshot", tmp_path / "two", "--snapshot-step", "12")
    assert second.returncode != 0
    third = run(1, *common, "--samples", tmp_path / "three.jsonl",
                "--snapshot", tmp_path / "three")
    assert third.returncode == 0, third.stderr[-3000:]
    # What each resumed run loaded is exactly what the other topology had when it saved:
    # weights, Adam moments and steps, learning rate.
    assert_same_snapshot(merged(tmp_path / "two.resumed", 2), merged(tmp_path / "one.step4", 1))
    assert_same_snapshot(merged(tmp_path / "three.resumed", 1),
                         merged(tmp_path / "two.step12", 2))
    # And each epoch read every sample exactly once across the topology changes.
    epoch0 = sample_ids(tmp_path / "one.jsonl", 0, before_batch=8) \
        + sample_ids(tmp_path / "two.jsonl", 0)
    epoch1 = sample_ids(tmp_path / "two.jsonl", 1, before_batch=4) \
        + sample_ids(tmp_path / "three.jsonl", 1)
    assert sorted(epoch0) == list(range(80)) and sorted(epoch1) == list(range(80))
    assert sample_ids(tmp_path / "three.jsonl", 0) == []
