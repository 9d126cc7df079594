"""Gradient accumulation: k micro-batches of b equal one batch of k*b, syncing once."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.helpers.launch import REPO, check, torchrun
from tests.helpers.tolerance import assert_close_to_scale
from tests.helpers.toy import ToyTrainer, toy_config


class StepCounter(ToyTrainer):
    """Records is_accumulating_gradients per micro-batch and the steps taken."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.accumulating: list[bool] = []
        self.optimizer_steps = 0

    def pre_train_batch(self, batch: Any, batch_idx: int) -> None:
        self.accumulating.append(self.is_accumulating_gradients)

    def post_optimizer_step(self, model: Any, optimizer: Any) -> None:
        self.optimizer_steps += 1


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_four_micro_batches_of_eight_equal_one_batch_of_32(optimizer: str) -> None:
    accumulated = StepCounter(toy_config(n_samples=128, train_batch_size=8,
                                         gradient_accumulation_steps=4, optimizer=optimizer))
    accumulated.fit()
    whole = ToyTrainer(toy_config(n_samples=128, train_batch_size=32, optimizer=optimizer))
    whole.fit()
    assert accumulated.global_step == whole.global_step == 4
    assert accumulated.optimizer_steps == 4
    assert accumulated.local_batches == 16 and whole.local_batches == 4
    assert accumulated.accumulating == [True, True, True, False] * 4
    for (name, a), (_, b) in zip(accumulated.model.state_dict().items(),
                                 whole.model.state_dict().items()):
        # Four micro-batch gradients added against one batch's: float32 sums in another order.
        assert_close_to_scale(a, b, ulps=16, msg=name)


def test_leftover_batches_that_cannot_fill_a_window_are_not_trained_on(
        caplog: pytest.LogCaptureFixture) -> None:
    trainer = StepCounter(toy_config(n_samples=80, train_batch_size=8,
                                     gradient_accumulation_steps=4))
    trainer.fit()
    assert trainer.global_step == 2 and trainer.local_batches == 8
    assert "the last 2 batches of each epoch are not used" in caplog.text


@pytest.mark.distributed
def test_ddp_accumulation_matches_and_all_reduces_once_per_window(tmp_path: Path) -> None:
    out = tmp_path / "result.pt"
    check(torchrun(REPO / "tests/scripts/ddp_accumulation.py", [str(out)]))
    result = torch.load(out)
    # 128 samples, 2 ranks, micro-batch 8: 8 micro-batches per rank, 2 optimizer steps.
    assert result["accumulated_allreduces"] == [2, 2]
    assert result["unaccumulated_allreduces"] == [8, 8]
    assert result["accumulated_steps"] == 2
    for name, tensor in result["whole"].items():
        assert_close_to_scale(result["accumulated"][name], tensor, ulps=16, msg=name)  # as above
