"""torchrun script: for each mode, fit the classifier, evaluate from post_fit and after fit
(on the validation set and on a held-out loader), with EarlyStopping attached; rank 0 saves
every result. The final weights are in each mode's last checkpoint.

Usage: evaluate_after_fit.py ROOT OUT MODE [MODE ...]
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from dream_trainer.callbacks import EarlyStopping
from dream_trainer.configs import DeviceParameters
from tests.helpers.classifier import ClassifierTrainer, classifier_config, held_out_loader
from tests.helpers.launch import save_on_rank_zero

MODES = {
    "two_sets": DeviceParameters.DDP(),
    "ddp": DeviceParameters.DDP(),
    "fsdp": DeviceParameters.FSDP(),
    "single": DeviceParameters.SINGLE_DEVICE(),
    "tp": DeviceParameters(dp_replicate=1, tensor_parallel=2),
    "hsdp": DeviceParameters.HSDP(dp_shard=2),
    "fsdp_tp": DeviceParameters(dp_shard=2, tensor_parallel=2),
}


class Evaluating(ClassifierTrainer):
    """Records the loop's validation result and evaluates again in post_fit."""

    post_fit_calls = 0

    def post_val_epoch(self, result: dict[str, Any]) -> None:
        super().post_val_epoch(result)
        if not self.evaluating:
            self.fit_result = dict(result)
            self.fit_results = [*getattr(self, "fit_results", []), (self.global_step, dict(result))]

    def post_fit(self) -> None:
        self.post_fit_calls += 1
        # EarlyStopping (patience 1, an unreachable improvement) would stop here if it
        # counted this pass: evaluation outside the loop must not drive it.
        self.in_post_fit = self.evaluate()
        super().post_fit()


MONITOR = "held_out/accuracy/MulticlassAccuracy"


def run(root: Path, mode: str) -> dict[str, Any]:
    if mode.startswith("two_sets"):
        return run_two_sets(root, MODES["single" if mode.endswith("single") else "two_sets"])
    stopper = EarlyStopping(monitor="val_loss", patience=1, min_delta=1e9)
    trainer = Evaluating(classifier_config(root, mode, MODES[mode], n_epochs=2))
    trainer.callbacks.append(stopper)
    trainer.callbacks.attach(trainer)
    trainer.fit()
    return {"fit": trainer.fit_result, "post_fit": trainer.in_post_fit,
            "after_fit": trainer.evaluate(), "held_out": trainer.evaluate(held_out_loader()),
            "post_fit_calls": trainer.post_fit_calls, "global_step": trainer.global_step,
            "checkpoint": str(trainer.checkpoint_dir)}


def run_two_sets(root: Path, device_parameters: DeviceParameters) -> dict[str, Any]:
    """Two named validation sets; checkpoints ranked by the second set's accuracy."""
    config = classifier_config(root, "two_sets", device_parameters, n_epochs=3)
    config = config.model_copy(update={
        "two_sets": True,
        "checkpoint_parameters": config.checkpoint_parameters.model_copy(update={
            "every_n_epochs": 1, "keep_top_k": 1, "monitor": MONITOR, "mode": "max"})})
    trainer = Evaluating(config)
    trainer.fit()
    return {"fit": trainer.fit_result, "per_epoch": trainer.fit_results,
            "after_fit": trainer.evaluate(), "post_fit": trainer.in_post_fit,
            "checkpoint": str(trainer.checkpoint_dir)}


def main(root: str, out: str, modes: list[str]) -> None:
    save_on_rank_zero({mode: run(Path(root), mode) for mode in modes}, out, "evaluate")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3:])
