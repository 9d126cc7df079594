"""``benchmarks.expert_steps`` without its 2-rank part: the bf16 grouped-vs-loop rows, and the
GPU mode run on the CPU with a tiny shape (every variant, float8 emulated), so that it keeps
working where there is no GPU. The times mean nothing here; what is checked is that each
variant trains what it says."""

from __future__ import annotations

import math

import pytest

from benchmarks import expert_steps
from benchmarks.expert_steps import Shape


def test_grouped_and_loop_train_the_same_bf16_model() -> None:
    result = expert_steps.grouped_vs_loop(steps=6, trials=1)
    assert result["grouped"] > 0 and result["loop"] > 0
    assert result["ratio_loop_to_grouped"] == pytest.approx(result["loop"] / result["grouped"])
    assert result["max_weight_difference"] == 0.0  # the two paths are bit-equal on the CPU
    rows = expert_steps.markdown({
        "layers": 4, "experts": 8, "top_k": 2, "ratio_ep2_to_one": 2.0,
        "ratio_spread": [1.9, 2.1], "median_step_seconds": {"one_process": 0.08},
        "bf16_grouped_vs_loop": result})
    assert rows[-1].startswith("| CPU bf16 step, experts in a loop / grouped_mm")


def test_the_gpu_mode_runs_every_variant_on_the_cpu() -> None:
    pytest.importorskip("torchao")
    shape = Shape(vocab=64, width=32, seq=16, layers=2, experts=4, batch=2)
    result = expert_steps.measure_gpu(steps=7, shape=shape, device="cpu")
    assert result["device"] == "cpu" and result["peak_flops"] is None
    for name in ("grouped", "loop", "grouped_float8_tensorwise", "grouped_float8_rowwise"):
        run = result[name]
        assert math.isfinite(run["tokens_per_second"]) and run["tokens_per_second"] > 0
        assert run["mfu"] is None  # no peak to count against on the CPU
        # embedding 64x32, 2 mixers 32x32+32, per layer a router 4x32 and 2 of the 4 experts
        # (top-2) of 3 matrices 32x64, head 32x64+64.
        assert run["active_parameters"] == 2048 + 2 * 1056 + 2 * (128 + 2 * 3 * 2048) + 2112
    # The mixing layers convert (the head and routers are filtered); the experts need CUDA
    # capability 9.0 for float8 grouped products, so on the CPU they stay bf16.
    assert result["grouped_float8_rowwise"]["float8_layers"] == shape.layers
    assert result["grouped"]["float8_layers"] == 0
    assert result["grouped_float8_rowwise"]["float8_experts"] == 0
