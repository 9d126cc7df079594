"""Profiler: a Chrome trace and an operator table per rank for a window of optimizer steps."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path
from typing import Any

import pytest

from dream_trainer.callbacks.profiler import Profiler
from tests.helpers.launch import check, torchrun
from tests.helpers.toy import ToyTrainer, toy_config


def step_markers(trace: Path) -> list[str]:
    events = json.loads(trace.read_text())["traceEvents"]
    return sorted({event["name"] for event in events
                   if event.get("name", "").startswith("ProfilerStep#")})


def test_the_window_is_written_as_trace_and_summary(tmp_path: Path) -> None:
    profiler = Profiler(start_step=1, num_steps=2, output_dir=tmp_path / "profile")
    ToyTrainer(toy_config(n_samples=48, gradient_accumulation_steps=2,
                          callbacks=[profiler])).fit()
    assert profiler.trace_path == tmp_path / "profile/trace_rank0.json"
    assert profiler.summary_path == tmp_path / "profile/summary_rank0.txt"
    # Step 1 warmed the profiler up; steps 2 and 3 were recorded.
    assert step_markers(profiler.trace_path) == ["ProfilerStep#1", "ProfilerStep#2"]
    summary = profiler.summary_path.read_text()
    assert "aten::" in summary and "Self CPU" in summary


def test_a_window_cut_short_by_the_end_of_training_is_written(tmp_path: Path) -> None:
    profiler = Profiler(start_step=1, num_steps=10, output_dir=tmp_path)
    ToyTrainer(toy_config(n_samples=32, callbacks=[profiler])).fit()
    assert profiler.trace_path is not None
    # Steps 2 to 4 were recorded, then what followed (validation) until fit() ended.
    assert step_markers(profiler.trace_path) == [f"ProfilerStep#{n}" for n in (1, 2, 3, 4)]


def test_a_window_after_the_last_step_writes_nothing(tmp_path: Path) -> None:
    profiler = Profiler(start_step=5, output_dir=tmp_path / "profile")
    ToyTrainer(toy_config(n_samples=16, callbacks=[profiler])).fit()
    assert profiler.trace_path is None and not (tmp_path / "profile").exists()


@pytest.mark.parametrize("kwargs", [{"start_step": 0}, {"num_steps": 0}])
def test_invalid_settings_are_rejected(kwargs: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        Profiler(**kwargs)


SCRIPT = """
import sys
from dream_trainer.callbacks.profiler import Profiler
from dream_trainer.configs import DeviceParameters
from tests.helpers.toy import ToyTrainer, toy_config

ToyTrainer(toy_config(n_samples=64, device_parameters=DeviceParameters.DDP(),
                      callbacks=[Profiler(start_step=1, num_steps=2,
                                          output_dir=sys.argv[1])])).fit()
"""


@pytest.mark.distributed
def test_every_rank_writes_its_own_files(tmp_path: Path) -> None:
    script = tmp_path / "profiled_run.py"  # not profile.py: that would shadow the stdlib
    script.write_text(textwrap.dedent(SCRIPT))
    check(torchrun(script, [str(tmp_path / "out")]))
    assert sorted(path.name for path in (tmp_path / "out").iterdir()) == [
        "summary_rank0.txt", "summary_rank1.txt", "trace_rank0.json", "trace_rank1.json"]
    assert step_markers(tmp_path / "out/trace_rank1.json") == ["ProfilerStep#1",
                                                              "ProfilerStep#2"]
