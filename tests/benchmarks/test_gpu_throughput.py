"""``benchmarks.gpu_throughput`` on the CPU: a tiny GPT through every variant, float8 rows
included (emulated), so the GPU benchmark keeps working where there is no GPU. The figures
mean nothing here; what is checked is that each variant trains what it says."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

pytest.importorskip("torchao")

from benchmarks import gpu_throughput
from benchmarks.__main__ import gpu_markdown
from benchmarks.gpt import LLAMA3_8B_WIDTHS, Block, GPTShape


def test_every_variant_runs_and_the_float8_rows_train_in_float8() -> None:
    shape = GPTShape(vocab=64, d_model=32, n_layers=2, n_heads=2, seq_len=16)
    result = gpu_throughput.measure(shape, batch_size=2, steps=2, warmup=1, trials=1,
                                    device=torch.device("cpu"), compile=False)
    variants = ["hand", "dream", "dream_no_callbacks", "dream_float8_tensorwise",
                "dream_float8_rowwise"]
    assert result["device"] == "cpu" and result["float8_recipes"] == ["tensorwise", "rowwise"]
    for name in variants:
        run = result[name]
        assert math.isfinite(run["tokens_per_second"]) and run["tokens_per_second"] > 0
        assert len(run["final_loss"]) == 1 and math.isfinite(run["final_loss"][0])
        assert run["mfu"] is None and run["peak_memory_gib"] is None  # no GPU peak to count
    # qkv, proj, up and down of each block convert; the head is filtered by default.
    assert result["dream_float8_tensorwise"]["float8_layers"] == 4 * shape.n_layers
    assert result["dream_float8_rowwise"]["float8_layers"] == 4 * shape.n_layers
    assert result["dream"]["float8_layers"] == 0
    # The trainer trains what the hand-written loop trains (same seed, batches and steps):
    # the same ops in the same order, equal bit for bit (measured on AVX512, AVX2 and ATen's
    # default kernels). float8 changes the numerics a little (the same absolute bound as
    # tests/parallel/test_float8.py: float8's rounding, not the CPU's, sets it).
    hand = result["hand"]["final_loss"][0]
    assert result["dream"]["final_loss"][0] == hand
    for recipe in ("tensorwise", "rowwise"):
        loss = result[f"dream_float8_{recipe}"]["final_loss"][0]
        assert 0 < abs(loss - hand) < 1e-2, recipe
        assert result[f"dream_float8_{recipe}_over_dream_throughput"] > 0
    rows = gpu_markdown(result)
    assert sum("float8 tensorwise" in row for row in rows) == 1
    assert sum("float8 rowwise" in row for row in rows) == 1


TINY_LLAMA = GPTShape(vocab=64, d_model=32, n_layers=4, n_heads=4, seq_len=16, n_kv_heads=2,
                      ffn_dim=48, swiglu=True)
"""``LLAMA3_8B_WIDTHS``' structure (grouped-query attention, a SwiGLU network of its own
width) at a CPU's size."""


def test_the_llama_widths_structure_runs_checkpointed_and_in_float8() -> None:
    assert (LLAMA3_8B_WIDTHS.d_model, LLAMA3_8B_WIDTHS.hidden, LLAMA3_8B_WIDTHS.n_heads,
            LLAMA3_8B_WIDTHS.kv_heads) == (4096, 14336, 32, 8)
    with torch.device("meta"):
        block = Block(LLAMA3_8B_WIDTHS)
    # Llama 3 8B's per-layer weights (q, k, v, o, gate, up, down), two norms aside.
    assert sum(p.numel() for name, p in block.named_parameters() if "norm" not in name) == \
        4096 * (4096 + 2 * 1024) + 4096 * 4096 + 3 * 4096 * 14336
    result = gpu_throughput.measure(TINY_LLAMA, batch_size=2, steps=2, warmup=1, trials=1,
                                    float8_recipes=("tensorwise",), device=torch.device("cpu"),
                                    compile=False, activation_checkpointing="full")
    assert result["activation_checkpointing"] == "full" and result["planned_gib"] > 0
    # Both checkpoint every block alike: the same losses bit for bit.
    assert result["dream"]["final_loss"][0] == result["hand"]["final_loss"][0]
    assert result["dream_float8_tensorwise"]["float8_layers"] == 4 * TINY_LLAMA.n_layers


def test_the_layers_that_fit_are_the_most_whose_plan_fits() -> None:
    totals = {layers: gpu_throughput.planned_bytes(replace(TINY_LLAMA, n_layers=layers), 2,
                                                   "full")
              for layers in (1, 2, 3)}
    assert totals[1] < totals[2] < totals[3]
    budget = (totals[2] + totals[3]) // 2
    assert gpu_throughput.layers_that_fit(TINY_LLAMA, 2, budget, "full") == 2
    assert gpu_throughput.layers_that_fit(TINY_LLAMA, 2, 10 * totals[3], "full") == 4
    with pytest.raises(ValueError, match="one layer of .* does not fit 0.0 GiB: lower"):
        gpu_throughput.layers_that_fit(TINY_LLAMA, 2, totals[1] - 1, "full")
