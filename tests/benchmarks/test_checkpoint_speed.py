"""The checkpoint benchmark runs (quick mode) and reports every figure."""

from __future__ import annotations

import math

from benchmarks.checkpoint_speed import measure


def test_checkpoint_benchmark_quick_mode() -> None:
    result = measure(size_mb=8, repeats=1)
    assert 0 < result["state_bytes"] < 16 * 2**20  # at least one layer: weights + 2 moments
    assert set(result["ratios"]) == {"dcp_save / torch_save", "dcp_load / torch_load",
                                     "async_block / sync_save"}
    assert all(math.isfinite(r) and r > 0 for r in result["ratios"].values())
