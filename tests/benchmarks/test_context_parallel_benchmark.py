"""``benchmarks.context_parallel``: what it counts, and its row of ``python -m benchmarks``.

The counter is checked in this process on tensors whose saved bytes are known; the row runs
in quick mode (a tiny rotary GPT, one process and cp=2 on 2 ranks) in a child process, so its
figures mean nothing, but its fields, categories and weights are checked.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from benchmarks.context_parallel import CATEGORIES, GPU_SHAPE, QUICK_SHAPE, SavedTensors, markdown
from tests.helpers.launch import REPO, check, child_env

FLOAT = 4  # bytes


def test_saved_tensors_count_each_storage_once_without_parameters_by_category() -> None:
    weight = nn.Parameter(torch.randn(8, 8))
    inputs = torch.randn(3, 8, requires_grad=True)
    scores = torch.randn(4, 8, requires_grad=True)
    keys = torch.randn(1, 2, 8, 3, requires_grad=True) * 2.0
    saved = SavedTensors(seq_len=8, local_len=4)
    with saved.watch():
        hidden = F.linear(inputs, weight)  # saves the inputs and a view of the parameter
        hidden * hidden  # saves one storage twice
        scores * torch.ones(4, 8)  # a [local, whole] mask
        keys * keys  # 4-D, the whole sequence along dim -2
    assert saved.bytes == {"attention_masks": 4 * 8 * FLOAT,
                           "gathered_keys_values": 2 * 8 * 3 * FLOAT,
                           "per_token": 2 * 3 * 8 * FLOAT}
    whole = SavedTensors(seq_len=8, local_len=8)
    with whole.watch():
        scores * torch.ones(4, 8)
    assert whole.bytes == {"attention_masks": 0, "gathered_keys_values": 0,
                           "per_token": 4 * 8 * FLOAT}


def test_a_gpu_result_with_one_gpu_says_cp2_was_left_out() -> None:
    result = {"device": "NVIDIA H100 80GB HBM3", "shape": vars(GPU_SHAPE),
              "cp1": {"tokens_per_second": 123456.7},
              "cp2_left_out": "cp=2 needs 2 GPUs; 1 present"}
    assert markdown(result) == [
        "| GPU (NVIDIA H100 80GB HBM3), cp=1 (8-block causal GPT, width 1024, 16,384 tokens) "
        "| 123,457 tokens/s |",
        "| GPU, cp=2 | left out: cp=2 needs 2 GPUs; 1 present |"]


@pytest.mark.distributed
def test_quick_run_reports_memory_and_step_time_of_cp1_and_cp2(tmp_path: Path) -> None:
    command = [sys.executable, "-m", "benchmarks", "--quick", "--out", str(tmp_path),
               "--only", "context_parallel"]
    check(subprocess.run(command, cwd=REPO, env=child_env(), capture_output=True, text=True,
                         timeout=600))
    result = json.loads((tmp_path / "results.json").read_text())["sections"]["context_parallel"]
    shape = QUICK_SHAPE
    assert result["device"] == "cpu" and result["trials"] == 1
    assert result["shape"] == {"vocab": shape.vocab, "width": shape.width,
                               "heads": shape.heads, "layers": shape.layers,
                               "seq_len": shape.seq_len, "batch": shape.batch}
    one, two = result["cp1"], result["cp2"]
    assert len(one["ranks"][0]) == 1 and len(two["ranks"][0]) == 2
    # One process gathers and masks nothing; each cp=2 rank holds every layer's whole keys
    # and values (float32) for backward, and one rank's bytes are the other's.
    assert one["activation_bytes_by_category"] == {
        "attention_masks": 0, "gathered_keys_values": 0,
        "per_token": one["activation_bytes"]}
    gathered = 2 * shape.layers * shape.batch * shape.seq_len * shape.width * FLOAT
    assert two["activation_bytes_by_category"]["gathered_keys_values"] == gathered
    assert set(two["activation_bytes_by_category"]) == set(CATEGORIES)
    assert two["activation_bytes"] == sum(two["activation_bytes_by_category"].values())
    first, second = two["ranks"][0]
    assert first["activation_bytes"] == second["activation_bytes"]
    assert 0 < two["activation_bytes"] < one["activation_bytes"]
    assert result["activation_ratio_cp2_to_cp1"] == \
        two["activation_bytes"] / one["activation_bytes"]
    for layout in (one, two):
        assert math.isfinite(layout["median_step_seconds"]) and layout["median_step_seconds"] > 0
        assert layout["tokens_per_second"] == \
            shape.batch * shape.seq_len / layout["median_step_seconds"]
    low, high = result["step_time_ratio_spread"]
    assert 0 < low <= result["step_time_ratio_cp2_to_cp1"] <= high
    # cp=2 trained the same model: the benchmark reports an absolute figure, and 1e-5 is ~80
    # float32 ulps at weights of scale 1, loose for a sanity check (tests/parallel's
    # test_context_parallel.py holds cp=2 to ulps of the scale) and tight for a wrong layout.
    assert result["max_weight_difference"] < 1e-5
    table = (tmp_path / "results.md").read_text()
    assert "| CPU activation memory per rank, cp=2 / cp=1 | " \
        f"{result['activation_ratio_cp2_to_cp1']:.3f} |" in table
    assert "| CPU step time per rank, cp=2 / cp=1 |" in table
