"""The LoRA memory benchmark runs both variants on 2 ranks (tiny size) and reports sane
fields; the figures at this size are noise, so no timing or memory ordering is checked."""

from __future__ import annotations

import pytest
import torch

from benchmarks.lora_memory import QUICK, build, markdown, measure


def test_the_shape_counts_parameters_as_the_models_hold_them() -> None:
    with torch.device("meta"):
        full, lora = build(QUICK, lora=False), build(QUICK, lora=True)
    assert QUICK.params() == sum(p.numel() for p in full.parameters()) == 34976
    # 2 layers x r=4 x the projections' in + out (q 64, k 48, v 48, o 64, gate, up, down 96).
    assert QUICK.adapter_params() == 2 * 4 * 512 == sum(
        p.numel() for p in lora.parameters() if p.requires_grad)


@pytest.mark.distributed
def test_lora_memory_benchmark_reports_both_variants_per_rank() -> None:
    result = measure(QUICK)
    assert result["params"] == QUICK.params() and result["model_bytes"] == 4 * QUICK.params()
    assert result["full"]["trainable_params"] == QUICK.params()
    assert result["lora"]["trainable_params"] == QUICK.adapter_params()
    for variant in ("full", "lora"):
        peaks = result[variant]["peak_above_baseline_bytes"]
        setup = result[variant]["setup_peak_above_baseline_bytes"]
        assert len(peaks) == len(setup) == 2
        # The peak at the end only grows from the one at the end of setup.
        assert all(0 < s <= p for s, p in zip(setup, peaks)), (variant, setup, peaks)
    assert result["ratio"] == max(result["lora"]["peak_above_baseline_bytes"]) / max(
        result["full"]["peak_above_baseline_bytes"])
    rows = markdown(result)
    assert len(rows) == 3 and rows[-1].endswith(f"| {result['ratio']:.2f} |")
