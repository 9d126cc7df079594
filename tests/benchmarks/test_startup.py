"""The start-up benchmark's timing and arithmetic (tests/benchmarks/test_harness.py runs every
variant's first step for real)."""

from __future__ import annotations

import math
import sys

import pytest

import benchmarks.startup
from benchmarks.startup import TINY_STEP, markdown, measure_first_step, measure_imports, time_import


def test_an_import_is_timed_to_the_line_printed_after_it() -> None:
    seconds = time_import(sys.executable, f"import dream_trainer, torch; {TINY_STEP}")
    assert math.isfinite(seconds) and seconds > 0


def test_import_ratios_subtract_each_interpreters_own_start(
        monkeypatch: pytest.MonkeyPatch) -> None:
    def fake(python: str, statement: str) -> float:
        start = 0.5 if python == "lightning-python" else 0.1
        if statement == "pass":
            return start
        cost = {"import torch": 2.0, "import lightning": 4.0, "import dream_trainer": 2.2}
        if TINY_STEP in statement:
            return start + (3.5 if statement.startswith("import torch") else 3.6)
        return start + cost[statement]

    monkeypatch.setattr(benchmarks.startup, "time_import", fake)
    result = measure_imports(repeats=2, lightning_python="lightning-python")
    assert set(result["import_seconds"]) == {"torch", "dream_trainer", "torch_ready_to_train",
                                             "dream_trainer_ready_to_train", "lightning"}
    assert result["import_seconds"]["lightning"]["median"] == pytest.approx(4.0)
    assert result["ratio_dream_trainer_to_torch"]["median"] == pytest.approx(1.1)
    assert result["ratio_ready_to_train"]["median"] == pytest.approx(3.6 / 3.5)
    assert result["ratio_lightning_to_torch"]["median"] == pytest.approx(2.0)
    assert result["meets_goal"] is True


def test_first_step_ratios_pair_each_round_with_its_hand_loop(
        monkeypatch: pytest.MonkeyPatch) -> None:
    fake = {"hand": 2.0, "base": 3.0, "dream": 4.0, "lightning": 5.0}
    monkeypatch.setattr(benchmarks.startup, "time_to_first_step",
                        lambda python, variant, workdir: fake[variant])
    result = measure_first_step(repeats=2, lightning_python="lightning-python")
    assert result["seconds"]["base"] == {"median": 3.0, "min": 3.0, "max": 3.0}
    assert {name: r["median"] for name, r in result["ratio_to_hand"].items()} == {
        "base": 1.5, "dream": 2.0, "lightning": 2.5}
    one = {"median": 1.0, "min": 1.0, "max": 1.0}
    imports = {"import_seconds": {"torch": one}, "ratio_dream_trainer_to_torch": one,
               "ratio_ready_to_train": one, "goal": 1.1}
    rows = markdown({"imports": imports, "first_step": result})
    assert len(rows) == 3 + 4 + 3
    assert all(row.startswith("| ") and row.endswith(" |") for row in rows)
