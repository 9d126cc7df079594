"""The LoRA checkpoint benchmark runs both settings on 2 ranks (tiny size) and reports sane
fields: the checkpoint without the frozen base is smaller by about the base. Times are only
checked to be times."""

from __future__ import annotations

import math

import pytest

from benchmarks.lora_checkpoint import VARIANTS, markdown, measure
from benchmarks.lora_memory import QUICK

SAVES = 2


@pytest.mark.distributed
def test_lora_checkpoint_benchmark_leaves_the_base_out_of_one_run_only() -> None:
    result = measure(QUICK, saves=SAVES)
    assert result["base_bytes"] == 4 * QUICK.params()  # save_pretrained of float32 weights
    left_out, full = result["frozen_left_out"], result["full_state"]
    for run in (left_out, full):
        assert run["checkpoint"] == f"step_{SAVES}"  # one save per step, the last measured
        seconds = run["save_seconds"]
        assert all(math.isfinite(s) and s > 0 for s in seconds.values())
        assert seconds["min"] <= seconds["median"] <= seconds["max"]
    # Both hold the adapters, their AdamW moments and the run state; the full state also holds
    # every base weight. The other records the base's source, checksum and keys instead (a
    # few KiB of models.json), so it is smaller by nearly the base's bytes.
    assert full["bytes"] - left_out["bytes"] > 0.9 * result["base_bytes"], result
    assert left_out["bytes"] > 3 * 4 * QUICK.adapter_params()
    assert result["bytes_ratio"] == left_out["bytes"] / full["bytes"] < 1
    assert set(VARIANTS) == {"frozen_left_out", "full_state"}
    rows = markdown(result)
    assert len(rows) == 3 and f"bytes {result['bytes_ratio']:.4f}" in rows[-1]
