"""EvalMixin: metrics over every rank equal the metric over the whole validation set."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.helpers.launch import REPO, check, child_env, torchrun
from tests.helpers.toy import toy_dataset, toy_model

SCRIPT = REPO / "tests/scripts/eval_run.py"


def full_set_metrics(weights: dict[str, torch.Tensor]) -> dict[str, float]:
    from tests.helpers.metrics import MetricsConfig

    config = MetricsConfig(project="p", group="g", experiment="e", dropout=0.2,
                           training_parameters={"n_epochs": 1, "train_batch_size": 4})
    model = toy_model(config)
    model.load_state_dict(weights)
    model.eval()
    x, y = toy_dataset(32, config, seed=2).tensors
    with torch.no_grad():
        prediction = model(x)
    return {"errors/mse": float(((prediction - y) ** 2).mean()),
            "errors/mae": float((prediction - y).abs().mean())}


def run(nproc: int, tmp_path: Path) -> dict[str, Any]:
    args = [str(tmp_path / "run"), str(tmp_path / "out.pt")]
    if nproc == 1:
        check(subprocess.run([sys.executable, str(SCRIPT), *args], env=child_env(), cwd=REPO,
                             capture_output=True, text=True, timeout=240))
    else:
        check(torchrun(SCRIPT, args, nproc=nproc))
    return torch.load(tmp_path / "out.pt")


@pytest.mark.parametrize("nproc", [1, pytest.param(2, marks=pytest.mark.distributed)])
def test_metrics_equal_the_full_validation_set_metric(tmp_path: Path, nproc: int) -> None:
    result = run(nproc, tmp_path)
    expected = full_set_metrics(result["weights"])
    metrics = result["metrics"]
    for key, value in expected.items():
        assert metrics[key] == pytest.approx(value, rel=1e-5), key
    # The metric no validation step updated contributes nothing, instead of failing.
    assert not any(key.startswith("unused/") for key in metrics)
    assert metrics["val_loss"] == pytest.approx(expected["errors/mse"], rel=1e-5)


def test_missing_torchmetrics_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    import builtins

    from dream_trainer.mixins.eval import _torchmetrics

    real_import = builtins.__import__

    def no_torchmetrics(name: str, *args: Any, **kwargs: Any) -> Any:
        if name == "torchmetrics":
            raise ImportError("No module named 'torchmetrics'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_torchmetrics)
    with pytest.raises(ImportError, match=r"pip install 'dream-trainer\[metrics\]'"):
        _torchmetrics()
