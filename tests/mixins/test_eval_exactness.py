"""Validation on N ranks is the validation of one process on the same weights and data, in
fit(), in evaluate() from post_fit and in evaluate() after fit(), in every parallel mode."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from dream_trainer.callbacks import EarlyStopping
from dream_trainer.checkpoint import export_checkpoint
from dream_trainer.configs import DeviceParameters
from tests.helpers.classifier import HELD_OUT, VAL, classification_set, one_process_results
from tests.helpers.launch import REPO, check, torchrun
from tests.helpers.tolerance import assert_close_to_scale

SCRIPT = REPO / "tests/scripts/evaluate_after_fit.py"


def final_weights(checkpoint_dir: str, out: Path) -> dict[str, torch.Tensor]:
    latest = max(Path(checkpoint_dir).glob("step_*"), key=lambda p: int(p.name.split("_")[1]))
    return load_file(export_checkpoint(latest, out)["model"])


def assert_equals_one_process(result: dict[str, Any], weights: dict[str, torch.Tensor],
                              mode: str) -> None:
    expected = one_process_results(weights, classification_set(VAL, seed=2))
    held_out = one_process_results(weights, classification_set(HELD_OUT, seed=3))
    for name in ("fit", "post_fit", "after_fit"):
        got = result[name]
        # Counts over the 361 samples, each counted once: exactly the same fraction.
        assert got["accuracy/MulticlassAccuracy"] == expected["accuracy/MulticlassAccuracy"], \
            (mode, name)
        # A sample-weighted mean of per-batch means against one sum: float32 rounding only.
        assert_close_to_scale(got["val_loss"], expected["val_loss"], ulps=16,
                              dtype=torch.float32, msg=f"{mode} {name}")
    assert result["held_out"]["accuracy/MulticlassAccuracy"] == \
        held_out["accuracy/MulticlassAccuracy"], mode
    assert_close_to_scale(result["held_out"]["val_loss"], held_out["val_loss"], ulps=16,
                          dtype=torch.float32, msg=mode)
    assert result["post_fit_calls"] == 1, mode


def run_modes(tmp_path: Path, nproc: int, modes: list[str]) -> tuple[dict[str, Any], str]:
    out = tmp_path / "results.pt"
    completed = check(torchrun(SCRIPT, [str(tmp_path / "runs"), str(out), *modes], nproc=nproc))
    return torch.load(out), completed.stderr


def test_one_process_evaluate_after_fit(tmp_path: Path) -> None:
    from tests.scripts.evaluate_after_fit import run

    result = run(tmp_path / "runs", "single")
    assert_equals_one_process(result, final_weights(result["checkpoint"], tmp_path / "w"),
                              "single")


def assert_two_sets(result: dict[str, Any], weights: dict[str, torch.Tensor]) -> None:
    """Each named set equals one process on that set, its keys prefixed with its name."""
    sets = {"val": one_process_results(weights, classification_set(VAL, seed=2)),
            "held_out": one_process_results(weights, classification_set(HELD_OUT, seed=3))}
    for name in ("fit", "post_fit", "after_fit"):
        got = result[name]
        assert sorted(got) == sorted(f"{s}/{k}" for s in sets for k in sets[s]), name
        for set_name, expected in sets.items():
            key = f"{set_name}/accuracy/MulticlassAccuracy"
            assert got[key] == expected["accuracy/MulticlassAccuracy"], (name, key)
            assert_close_to_scale(got[f"{set_name}/val_loss"], expected["val_loss"], ulps=16,
                                  dtype=torch.float32, msg=f"{name} {set_name}")  # as above


def assert_ranked_by_the_second_set(result: dict[str, Any]) -> None:
    from dream_trainer.checkpoint import CheckpointInfo
    from tests.scripts.evaluate_after_fit import MONITOR

    scores = {step: values[MONITOR] for step, values in result["per_epoch"]}
    infos = [CheckpointInfo.read(path) for path in sorted(Path(result["checkpoint"]).glob("step_*"))]
    assert all(info.score == scores[info.step] for info in infos)
    newest = max(scores)
    best = max(scores, key=lambda step: (scores[step], step))
    assert {info.step for info in infos} == {best, newest}  # keep_top_k=1, plus the newest


def test_one_process_two_validation_sets(tmp_path: Path) -> None:
    from tests.scripts.evaluate_after_fit import run

    result = run(tmp_path / "runs", "two_sets_single")
    assert_two_sets(result, final_weights(result["checkpoint"], tmp_path / "w"))
    assert_ranked_by_the_second_set(result)


@pytest.mark.distributed
def test_two_ranks_ddp_fsdp_tp_and_two_sets_equal_one_process(tmp_path: Path) -> None:
    results, _ = run_modes(tmp_path, 2, ["ddp", "fsdp", "tp", "two_sets"])
    for mode, result in results.items():
        weights = final_weights(result["checkpoint"], tmp_path / mode)
        if mode == "two_sets":
            assert_two_sets(result, weights)
            assert_ranked_by_the_second_set(result)
        else:
            assert_equals_one_process(result, weights, mode)


@pytest.mark.distributed
def test_four_ranks_hsdp_and_fsdp_tp_equal_one_process_and_print_no_torch_warning(
        tmp_path: Path) -> None:
    results, stderr = run_modes(tmp_path, 4, ["fsdp_tp", "hsdp"])
    for mode, result in results.items():
        weights = final_weights(result["checkpoint"], tmp_path / mode)
        assert_equals_one_process(result, weights, mode)
    # The launcher's own notes (OMP_NUM_THREADS) are not the ranks'; a rank's torch warning
    # is a "[rankN]:W..." log line or a Python "...Warning:" line.
    rank_warnings = [line for line in stderr.splitlines()
                     if re.match(r"\[rank\d+\]:W", line) or re.search(r"\w+Warning: ", line)]
    assert rank_warnings == [], "\n".join(rank_warnings)


def test_early_stopping_ignores_an_evaluation_in_post_fit_and_post_fit_fires_once(
        tmp_path: Path) -> None:
    from tests.scripts.evaluate_after_fit import Evaluating
    from tests.helpers.classifier import classifier_config

    trainer = Evaluating(classifier_config(tmp_path, "complete", DeviceParameters.SINGLE_DEVICE()))
    # Patience 1 and an improvement nobody reaches: the evaluation in post_fit would be the
    # second check, and stop, if it counted.
    trainer.callbacks.append(EarlyStopping(monitor="val_loss", patience=1, min_delta=1e9))
    trainer.callbacks.attach(trainer)
    trainer.fit()
    assert trainer.post_fit_calls == 1
    assert len(list((tmp_path / "classifier/tests/complete/checkpoints").iterdir())) == 1


def test_stop_training_where_nothing_can_stop_is_an_error(tmp_path: Path) -> None:
    from dream_trainer import StopTraining
    from tests.helpers.classifier import ClassifierTrainer, classifier_config

    class StopsLate(ClassifierTrainer):
        def post_fit(self) -> None:
            super().post_fit()
            raise StopTraining("too late")

    with pytest.raises(RuntimeError, match="StopTraining was raised in post_fit, after "
                                           "training ended, where it cannot stop anything"):
        StopsLate(classifier_config(tmp_path, "late", DeviceParameters.SINGLE_DEVICE())).fit()
