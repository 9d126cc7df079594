"""Loggers: what is logged, when, on which rank, and across a resume."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dream_trainer.configs import LoggingParameters
from tests.helpers.checkpointing import checkpointed_config
from tests.helpers.metrics import MetricsConfig, MetricsTrainer, WandBConfig, WandBTrainer
from tests.helpers.wandb_files import read_run


def config(root: Path, kind: type = MetricsConfig, epochs: int = 1, **extra: object) -> MetricsConfig:
    base = checkpointed_config(root, resume="latest")
    fields = {**dict(base), "val_samples": 32, **extra,
              "logging_parameters": LoggingParameters(log_dir=root, log_every_n_steps=4)}
    fields["training_parameters"] = base.training_parameters.model_copy(
        update={"n_epochs": epochs})
    return kind(**fields)


def test_json_logger_writes_steps_epochs_and_validation(tmp_path: Path) -> None:
    MetricsTrainer(config(tmp_path)).fit()
    logs = tmp_path / "ckpt/tests/run/logs"
    rows = [json.loads(line) for line in (logs / "metrics.jsonl").read_text().splitlines()]
    step_rows = [row for row in rows if "trainer/global_step" in row]
    assert [row["step"] for row in step_rows] == [4, 8]
    assert {"loss", "grad_norm", "trainer/epoch"} <= set(step_rows[0])
    assert not any(key.startswith("lr/") for key in step_rows[0])  # LRMonitor's job
    assert any("train_epoch/loss" in row for row in rows)
    # Epoch-end validation, and the evaluate() call in the test trainer's post_fit.
    validation = [row for row in rows if "errors/mse" in row]
    assert [row["step"] for row in validation] == [10, 10]
    assert json.loads((logs / "config.json").read_text())["experiment"] == "run"


def test_wandb_offline_run_keeps_its_id_and_steps_across_a_resume(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WANDB_SILENT", "true")
    first = WandBTrainer(config(tmp_path, WandBConfig, epochs=1))
    assert first.wandb_run is None  # constructing never starts wandb
    first.fit()
    WandBTrainer(config(tmp_path, WandBConfig, epochs=2)).fit()
    runs = sorted((tmp_path / "ckpt/tests/run/logs/wandb").glob("offline-run-*"))
    assert len(runs) == 2
    first_run, second_run = (read_run(next(run.glob("run-*.wandb"))) for run in runs)
    assert first_run["id"] == second_run["id"]
    assert (first_run["project"], first_run["group"], first_run["name"]) == ("ckpt", "tests", "run")
    steps = [row["_step"] for run in (first_run, second_run) for row in run["history"]]
    assert steps == sorted(steps) and steps[-1] == 20
    assert any("errors/mse" in row for row in second_run["history"])
    assert any(row.get("loss") is not None for row in first_run["history"])
