"""The step-overhead benchmark's workloads: what each trains, and that ``BaseTrainer`` trains
exactly what the hand-written loop trains (the harness test runs ``mlp``; this runs the
others' code paths on a few steps)."""

from __future__ import annotations

import math

import pytest

from benchmarks import step_overhead
from benchmarks.workloads import MODELS, batch_size, build_model, dataset


def test_mlp512_is_three_layers_of_width_512_on_batches_of_64() -> None:
    model = build_model("mlp512")
    shapes = [tuple(p.shape) for p in model.parameters() if p.dim() == 2]
    assert shapes == [(512, 512), (512, 512), (10, 512)]
    assert batch_size("mlp512") == 64 and batch_size("mlp") == 32
    inputs, labels = dataset("mlp512", 3)[:]
    assert inputs.shape == (3, 512) and int(labels.max()) < 10
    assert set(MODELS) == {"mlp", "mlp512", "transformer"}


@pytest.mark.parametrize("kind", ["mlp512", "transformer"])
def test_base_trainer_trains_what_the_hand_loop_trains(kind: str) -> None:
    result = step_overhead.measure(kind, steps=24, trials=1)
    assert result["base_weights_identical_to_hand"] is True
    assert result["model"] == kind and set(result["ratio_to_hand"]) == {"base", "dream"}
    assert all(math.isfinite(r) and r > 0 for r in result["ratio_to_hand"].values())
