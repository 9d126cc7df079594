"""NanGuard: raising at the first non-finite value, and skipping non-finite updates (its
diagnosis of where a value came from is in test_nan_provenance.py)."""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from dream_trainer.callbacks import Callback
from dream_trainer.callbacks.nan_guard import NanGuard
from dream_trainer.checkpoint import CheckpointError, export_checkpoint
from dream_trainer.configs import DeviceParameters
from tests.helpers.checkpointing import CheckpointedTrainer, checkpointed_config
from tests.helpers.toy import ToyTrainer, toy_config

NAN = float("nan")


class NanLoss(ToyTrainer):
    """The toy trainer, with its loss multiplied by NaN while ``global_step == nan_step``."""

    nan_step: int | None = None
    nan_in: str = "loss"  # or "backward": only the gradients become NaN

    def training_step(self, batch: Any, batch_idx: int) -> dict[str, Any]:
        x, y = batch
        loss = F.mse_loss(self.model(x), y)
        poisoned = loss * NAN if self.global_step == self.nan_step else loss
        if self.nan_in == "loss":
            loss = poisoned
        self.backward(poisoned)
        if not self.is_accumulating_gradients:
            return {"loss": loss, "grad_norm": self.step(self.model, self.optimizer)}
        return {"loss": loss}


class NanCheckpointed(CheckpointedTrainer, NanLoss):
    """The checkpointed toy (dropout, schedule, accumulation) with the NaN injection."""


class StepWeights(Callback):
    """The weights after every optimizer step, by global step (0: after setup)."""

    def post_setup(self) -> None:
        self.after = {0: self.snapshot()}

    def post_train_batch(self, result: dict[str, Any], batch_idx: int) -> None:
        if not self.trainer.is_accumulating_gradients:
            self.after[self.trainer.global_step] = self.snapshot()

    def snapshot(self) -> dict[str, torch.Tensor]:
        model = getattr(self.trainer.model, "module", self.trainer.model)
        return {k: v.detach().clone() for k, v in model.named_parameters()}


def nan_trainer(nan_step: int, guard: NanGuard, nan_in: str = "loss",
                **training: Any) -> NanLoss:
    trainer = NanLoss(toy_config(callbacks=[guard], **training))
    trainer.nan_step, trainer.nan_in = nan_step, nan_in
    return trainer


@pytest.mark.parametrize(("every", "raised_at"), [(1, 5), (3, 6)])
def test_raise_names_the_first_bad_step(every: int, raised_at: int) -> None:
    # Without diagnosis the check runs after each step, on the values training_step returned.
    trainer = nan_trainer(4, NanGuard(check_every_n_steps=every, diagnose=False))
    with pytest.raises(FloatingPointError, match=r"global step 4 \(batch 4 of epoch 0\): "
                                                 r"loss=nan, grad_norm=nan"):
        trainer.fit()
    # Checked only every `every` steps: with 3, steps 5 and 6 ran before the check at 6.
    assert trainer.global_step == raised_at


def test_raise_catches_gradients_through_grad_norm() -> None:
    trainer = nan_trainer(2, NanGuard(diagnose=False), nan_in="backward",
                          gradient_accumulation_steps=2)
    with pytest.raises(FloatingPointError, match=r"global step 2 \(batch 5 of epoch 0\): "
                                                 r"grad_norm=nan"):
        trainer.fit()


def test_raise_checks_at_the_end_of_the_epoch() -> None:
    trainer = nan_trainer(18, NanGuard(check_every_n_steps=100))
    with pytest.raises(FloatingPointError, match="global step 18"):
        trainer.fit()
    assert trainer.global_step == 20  # the epoch's 20 steps ran; its end checked them


def test_raise_passes_finite_training() -> None:
    guard = NanGuard(check_every_n_steps=3, keys=("loss", "grad_norm"))
    trainer = nan_trainer(-1, guard, n_epochs=2)
    trainer.fit()
    assert trainer.global_step == 40 and guard.skipped_steps == 0


def test_raise_requires_the_checked_keys() -> None:
    with pytest.raises(KeyError, match=r"NanGuard checks \['total'\] but training_step "
                                       r"returned only \['grad_norm', 'loss'\]"):
        nan_trainer(-1, NanGuard(keys=("total",))).fit()


def test_skip_leaves_the_weights_of_the_bad_step_unchanged(
        caplog: pytest.LogCaptureFixture, tmp_path: Path) -> None:
    guard, log = NanGuard(mode="skip", output_dir=tmp_path), StepWeights()
    trainer = NanLoss(toy_config(callbacks=[guard, log]))
    trainer.nan_step = 5
    with caplog.at_level(logging.WARNING, logger="dream_trainer.callbacks.nan_guard"):
        trainer.fit()
    assert trainer.global_step == 20 and guard.skipped_steps == 1
    assert "non-finite gradients at global step 5 (batch 5 of epoch 0)" in caplog.text
    # The step taken on the poisoned batch (global step 5 -> 6) changed nothing ...
    for key, before in log.after[5].items():
        assert torch.equal(log.after[6][key], before), key
    # ... while the steps around it trained, and everything stayed finite.
    assert not torch.equal(log.after[5]["0.weight"], log.after[4]["0.weight"])
    assert not torch.equal(log.after[7]["0.weight"], log.after[6]["0.weight"])
    for key, weight in log.after[20].items():
        assert torch.isfinite(weight).all(), key


def checkpoint_values(root: Path, out: Path) -> dict[str, dict[str, torch.Tensor]]:
    """Every saved checkpoint's model weights, exported to one process, by directory."""
    checkpoints = sorted(root.rglob("step_*"))
    assert checkpoints
    return {path.name: load_file(export_checkpoint(path, out / path.name)["model"])
            for path in checkpoints}


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # export: one process
def test_skip_keeps_non_finite_weights_out_of_checkpoints(tmp_path: Path) -> None:
    # Step 4 is poisoned and a checkpoint is saved right after it.
    def run(root: Path, guard: NanGuard | None) -> dict[str, dict[str, torch.Tensor]]:
        trainer = NanCheckpointed(checkpointed_config(root, DeviceParameters()))
        trainer.nan_step = 3
        if guard is not None:
            trainer.callbacks.append(guard)
            trainer.callbacks.attach(trainer)
        trainer.fit()
        return checkpoint_values(root, tmp_path / f"export_{root.name}")

    guard = NanGuard(mode="skip", output_dir=tmp_path / "nan")
    guarded = run(tmp_path / "guarded", guard)
    assert guard.skipped_steps == 1
    assert set(guarded) == {"step_4", "step_8", "step_10", "step_12", "step_16", "step_20",
                            "step_24", "step_28", "step_30"}
    for name, tensors in guarded.items():
        for key, tensor in tensors.items():
            assert torch.isfinite(tensor).all(), (name, key)
    # Not vacuous: unguarded, the weights are NaN by step 4, whose save the mixin refuses.
    with pytest.raises(CheckpointError, match="not saving step 4: the model has non-finite"):
        run(tmp_path / "unguarded", None)


def test_skip_refuses_float16() -> None:
    trainer = NanLoss(toy_config(callbacks=[NanGuard(mode="skip")],
                                 device_parameters=DeviceParameters(param_dtype="float16")))
    with pytest.raises(ValueError, match="float16"):
        trainer.fit()


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"mode": "ignore"}, "mode must be 'raise'"),
    ({"check_every_n_steps": 0}, "check_every_n_steps"),
    ({"check_every_n_steps": 2.0}, "check_every_n_steps"),
    ({"mode": "skip", "check_every_n_steps": 2}, "skip mode must check every step"),
    ({"keys": "loss"}, "keys must be a tuple"),
    ({"keys": ("loss", "")}, "keys must be a tuple"),
    ({"diagnose": 1}, "diagnose"),
])
def test_arguments_are_validated(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        NanGuard(**kwargs)


def test_non_scalar_values_count_every_element() -> None:
    guard = NanGuard(keys=("per_class",))
    guard.trainer = ToyTrainer(toy_config())
    assert math.isnan(guard._as_scalar("per_class", torch.tensor([1.0, NAN, 2.0])).item())
    assert math.isinf(guard._as_scalar("per_class", torch.tensor([[1.0, -math.inf]])).item())
    assert guard._as_scalar("per_class", 3).item() == 3.0
    with pytest.raises(TypeError, match="'per_class'"):
        guard._as_scalar("per_class", "nan")
