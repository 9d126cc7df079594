"""The Lightning runner trains the hand loop's workload and reports its step times (quick mode).

Lightning lives in its own virtual environment: its interpreter is the one named by
``DREAM_BENCH_LIGHTNING_PYTHON``, else ``/tmp/lightning-venv/bin/python`` if it exists.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import pytest

from benchmarks.lightning_steps import markdown, measure

DEFAULT_LIGHTNING_PYTHON = Path("/tmp/lightning-venv/bin/python")


def find_lightning_python() -> str | None:
    named = os.environ.get("DREAM_BENCH_LIGHTNING_PYTHON")
    if named:
        return named
    return str(DEFAULT_LIGHTNING_PYTHON) if DEFAULT_LIGHTNING_PYTHON.exists() else None


LIGHTNING_PYTHON = find_lightning_python()
needs_lightning = pytest.mark.skipif(
    LIGHTNING_PYTHON is None,
    reason="no interpreter with Lightning: set DREAM_BENCH_LIGHTNING_PYTHON or create "
           f"{DEFAULT_LIGHTNING_PYTHON.parent.parent} (torch==2.13.0 + lightning)")


@needs_lightning
def test_one_process_ends_with_the_hand_loops_weights() -> None:
    assert LIGHTNING_PYTHON is not None
    result = measure(LIGHTNING_PYTHON, "mlp", steps=30, devices=1, trials=1)
    assert result["weights_identical_to_hand"] is True
    for key in ("lightning_step_seconds", "hand_step_seconds", "ratio_lightning_to_hand"):
        assert set(result[key]) == {"median", "min", "max"}
        assert all(math.isfinite(v) and v > 0 for v in result[key].values())
    rows = markdown(result)
    assert len(rows) == 3 and all(row.startswith("| ") and row.endswith(" |") for row in rows)
