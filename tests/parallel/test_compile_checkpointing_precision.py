"""Activation checkpointing, compilation and float16 scaling, each against a plain run."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

from dream_trainer.configs import DeviceParameters
from tests.helpers.transformer import TransformerTrainer, transformer_config
from tests.helpers.tolerance import assert_close_to_scale


def train(device_parameters: DeviceParameters, trainer_class: type = TransformerTrainer,
          steps: int = 4) -> TransformerTrainer:
    trainer = trainer_class(transformer_config(device_parameters, batch=8, max_steps=steps))
    trainer.fit()
    return trainer


def params(trainer: TransformerTrainer) -> dict[str, torch.Tensor]:
    # Wrappers add prefixes to names; compare by position, which they do not change.
    return {str(i): p.detach() for i, p in enumerate(trainer.model.parameters())}


@pytest.fixture(scope="module")
def plain() -> dict[str, torch.Tensor]:
    return params(train(DeviceParameters.SINGLE_DEVICE()))


def test_activation_checkpointing_wraps_blocks_and_changes_nothing(
        plain: dict[str, torch.Tensor]) -> None:
    trainer = train(DeviceParameters.SINGLE_DEVICE(checkpoint_activations=True))
    assert all(isinstance(layer, CheckpointWrapper) for layer in trainer.model.layers)
    for name, tensor in plain.items():
        assert torch.equal(params(trainer)[name], tensor), name


def test_compile_compiles_each_block_and_trains_the_same(plain: dict[str, torch.Tensor]) -> None:
    trainer = train(DeviceParameters.SINGLE_DEVICE(compile_model=True))
    assert all(isinstance(layer, torch._dynamo.eval_frame.OptimizedModule)
               for layer in trainer.model.layers)
    for name, tensor in plain.items():
        # Fused kernels round differently from eager ones, in every op forward and backward
        # (up to 4.9 ulps of the scale seen on AVX512, AVX2 and ATen's default kernels).
        assert_close_to_scale(params(trainer)[name], tensor, ulps=32, msg=name)


def test_float16_scales_the_loss_and_skips_overflowing_steps() -> None:
    class Overflow(TransformerTrainer):
        """Makes the gradients of the second optimizer step (global_step 1 -> 2) infinite."""

        def pre_train_batch(self, batch: Any, batch_idx: int) -> None:
            if self.global_step == 1:
                self.before_overflow = [p.detach().clone() for p in self.model.parameters()]
                self.handles = [p.register_hook(lambda grad: grad * float("inf"))
                                for p in self.model.parameters()]

        def post_train_batch(self, result: dict[str, Any], batch_idx: int) -> None:
            if self.global_step == 2:
                self.after_overflow = [p.detach().clone() for p in self.model.parameters()]
                for handle in self.handles:
                    handle.remove()

    trainer = train(DeviceParameters.SINGLE_DEVICE(param_dtype="fp16"), Overflow, steps=3)
    assert trainer.precision.scaler is not None
    assert trainer.update_vote.skipped == {"float16_overflow": 1}
    assert all(torch.equal(a, b) for a, b in zip(trainer.before_overflow, trainer.after_overflow))
    assert trainer.precision.scaler.get_scale() < 2.0 ** 16
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())
