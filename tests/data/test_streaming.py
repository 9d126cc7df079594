"""A stateful streaming loader (torchdata StatefulDataLoader, 2 worker processes) on an
endless iterable: n_epochs=None + max_steps, SIGKILL and resume without re-reading."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch

from tests.helpers.launch import REPO, run_script

SCRIPT = REPO / "tests/scripts/stream_run.py"
BATCH, CHECKPOINT_STEP = 4, 4


def run(nproc: int, *args: str | Path) -> subprocess.CompletedProcess[str]:
    return run_script(SCRIPT, nproc, *args)


def reads(log: Path) -> set[int]:
    return {json.loads(line)["index"] for line in log.read_text().splitlines()}


@pytest.mark.distributed
@pytest.mark.parametrize("nproc", [1, 2])
def test_sigkill_then_resume_reads_nothing_already_trained_on_and_is_bit_exact(
        nproc: int, tmp_path: Path) -> None:
    whole = run(nproc, tmp_path / "whole", tmp_path / "whole.pt")
    assert whole.returncode == 0, whole.stderr[-3000:]
    (tmp_path / "markers").mkdir()
    common = [tmp_path / "split", tmp_path / "split.pt", "--markers", tmp_path / "markers"]
    # Killed after step 7: the newest checkpoint is step 4.
    killed = run(nproc, *common, "--kill", "step:7", "--read-log", tmp_path / "killed.jsonl")
    assert killed.returncode != 0
    if nproc == 2:
        # The stream's position belongs to each rank: one process cannot take two ranks',
        # even with the same global batch (twice the accumulation).
        refused = run(1, *common, "--accumulation", "2")
        assert refused.returncode != 0
        assert ("holds the train loader's position for 2 data-parallel ranks, and this run "
                "has 1") in refused.stderr
        assert "dream_trainer.data.ShardedStream" in refused.stderr  # the alternative
    resumed = run(nproc, *common, "--read-log", tmp_path / "resumed.jsonl")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    expected, actual = torch.load(tmp_path / "whole.pt"), torch.load(tmp_path / "split.pt")
    assert expected["global_step"] == actual["global_step"] == 10  # the step budget
    for name, tensor in expected["weights"].items():
        assert torch.equal(actual["weights"][name], tensor), name
    for index, state in expected["optimizer"].items():
        for key, tensor in state.items():
            assert torch.equal(actual["optimizer"][index][key], tensor), (index, key)
    assert actual["trained_on"] == expected["trained_on"]
    # No sample trained on before the checkpoint was read again: the resumed loader
    # started from its saved position (the killed run's reads beyond it, prefetched or
    # trained on in steps 5-7, are read again, as they must be).
    before = {i for ids in expected["trained_on"] for i in ids[:CHECKPOINT_STEP * BATCH]}
    after = {i for ids in expected["trained_on"] for i in ids[CHECKPOINT_STEP * BATCH:]}
    resumed_reads = reads(tmp_path / "resumed.jsonl")
    assert not resumed_reads & before
    assert after <= resumed_reads
    assert before <= reads(tmp_path / "killed.jsonl")
