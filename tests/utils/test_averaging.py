"""Epoch results: means per key, over the steps that produced the key."""

from __future__ import annotations

import math

import pytest
import torch

from dream_trainer.utils import averaging
from dream_trainer.utils.averaging import ResultAverager


def test_means_per_key_ignoring_non_scalars() -> None:
    averager = ResultAverager(torch.device("cpu"))
    averager.update({"loss": torch.tensor(1.0, requires_grad=True), "logits": torch.ones(3),
                     "name": "x", "flag": True})
    averager.update({"loss": 3, "grad_norm": torch.tensor([4.0])})
    assert averager.compute() == {"loss": 2.0, "grad_norm": 4.0}


def test_keys_come_back_in_the_order_they_first_came(monkeypatch: pytest.MonkeyPatch) -> None:
    # Folding pops and re-adds a key's running sum; the result keeps the user's order anyway,
    # so a logger's columns follow the training_step's dict, not the alphabet.
    monkeypatch.setattr(averaging, "_FOLD_EVERY", 2)
    averager = ResultAverager(torch.device("cpu"))
    for value in range(5):
        averager.update({"zeta": value, "alpha": value})
        averager.update({"zeta": value, "mid": value})
    assert list(averager.compute()) == ["zeta", "alpha", "mid"]


def test_folding_keeps_long_epochs_exact(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(averaging, "_FOLD_EVERY", 4)
    averager = ResultAverager(torch.device("cpu"))
    for value in range(1, 11):
        averager.update({"v": torch.tensor(float(value))})
    assert math.isclose(averager.compute()["v"], 5.5)


def test_empty_epoch_gives_empty_result() -> None:
    assert ResultAverager(torch.device("cpu")).compute() == {}
