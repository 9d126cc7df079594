"""The meta-device setup keeps each rank's memory near its shard of the model."""

from __future__ import annotations

import pytest

from benchmarks.meta_init_memory import measure


@pytest.mark.distributed
def test_sharded_setup_of_a_1gb_model_stays_below_0_6_of_it_per_rank() -> None:
    result = measure(size_mb=1024)
    assert 1.0e9 < result["model_bytes"] < 1.2e9
    # Each rank holds half the weights plus one full-size tensor while it initializes it.
    assert result["meta"]["ratio_to_model"] < 0.6
    # The comparison is meaningful: building the model whole costs the whole model.
    assert result["naive"]["ratio_to_model"] > 0.95
