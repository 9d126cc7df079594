"""Retention ranks checkpoints whose monitored value is NaN or missing below every scored one,
in both modes, wherever they sit in the run, and says so once."""

from __future__ import annotations

import logging
import math
from pathlib import Path

import pytest

from dream_trainer.checkpoint.directory import METADATA, CheckpointInfo, step_dir
from dream_trainer.checkpoint.retention import rotate
from dream_trainer.configs import CheckpointParameters

NAN = math.nan


def checkpoints(root: Path, scores: list[float | None], first: int = 1) -> None:
    """Complete checkpoints at steps ``first``, ``first + 1``, ... with these monitor values."""
    for step, score in enumerate(scores, start=first):
        path = step_dir(root, step)
        path.mkdir(parents=True)
        (path / METADATA).write_bytes(b"")
        CheckpointInfo(path, step, 0, score).write()


def kept(root: Path) -> list[str]:
    return sorted(path.name for path in root.iterdir())


@pytest.mark.parametrize("mode, scores, expected", [
    # The case: the 0.5 checkpoint was deleted.
    ("min", [NAN, 0.5, 0.9], ["step_2", "step_3"]),
    ("min", [0.5, 0.9, NAN], ["step_1", "step_3"]),  # the newest is always kept
    ("min", [0.9, NAN, 0.5, 0.7], ["step_3", "step_4"]),
    ("max", [NAN, 0.9, 0.5], ["step_2", "step_3"]),
    ("max", [0.9, 0.5, NAN], ["step_1", "step_3"]),
    ("max", [0.5, NAN, 0.9, 0.7], ["step_3", "step_4"]),
    ("min", [None, 0.5, 0.9], ["step_2", "step_3"]),
    ("max", [None, 0.9, 0.5], ["step_2", "step_3"]),
])
def test_keep_top_k_keeps_the_best_finite_checkpoint(
        tmp_path: Path, mode: str, scores: list[float | None], expected: list[str]) -> None:
    checkpoints(tmp_path, scores)
    rotate(tmp_path, CheckpointParameters(keep_top_k=1, monitor="val_loss", mode=mode,
                                          every_n_steps=1), None)
    assert kept(tmp_path) == expected


def test_unscored_checkpoints_rank_below_every_scored_one_and_are_warned_about_once(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    checkpoints(tmp_path, [NAN, 0.1, None, 0.3, 0.2])
    params = CheckpointParameters(keep_top_k=3, monitor="val_loss", every_n_steps=1)
    with caplog.at_level(logging.WARNING, logger="dream_trainer"):
        rotate(tmp_path, params, None)
        assert kept(tmp_path) == ["step_2", "step_4", "step_5"]
        checkpoints(tmp_path, [NAN], first=6)  # the run's next save
        rotate(tmp_path, params, None)
        assert kept(tmp_path) == ["step_2", "step_4", "step_5", "step_6"]
    warnings = [record.getMessage() for record in caplog.records]
    assert warnings == [f"checkpoint {step_dir(tmp_path, 1)} has monitor 'val_loss' NaN: "
                        "keep_top_k ranks such checkpoints below every checkpoint with a value "
                        "(warned once per run)"]
