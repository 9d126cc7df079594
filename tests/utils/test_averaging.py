"""Epoch results: means per key, over the steps that produced the key."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch

from dream_trainer.utils import averaging
from dream_trainer.utils.averaging import ResultAverager
from tests.helpers.launch import REPO, check, torchrun


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


def test_a_fold_over_mixed_columns_gives_the_exact_weighted_means(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # Folds convert a whole column at once where they can (numbers; tensors of one kind) and
    # item by item otherwise; either way every value counts with its own step's weight.
    monkeypatch.setattr(averaging, "_FOLD_EVERY", 3)
    big = 2**40 + 1  # exact in float64, not in float32
    steps: list[tuple[dict[str, Any], Any]] = [
        ({"loss": torch.tensor(1.0), "big": torch.tensor(big), "num_items": 2}, 2),
        ({"loss": 3, "big": torch.tensor([big + 2])}, torch.tensor(4)),
        ({"loss": torch.tensor(5.0, dtype=torch.float64), "only": 7.5}, 1),
        ({"loss": torch.tensor(float("nan")), "num_items": 3, "only": 1.5}, 0),  # counts 0
        ({"loss": torch.tensor([[2.0]]), "big": big + 4, "only": 3.5}, 1),
    ]
    averager = ResultAverager(torch.device("cpu"))
    for result, weight in steps:
        averager.update(result, weight)
    assert averager.compute() == {"loss": (1 * 2 + 3 * 4 + 5 * 1 + 2 * 1) / 8,
                                  "big": (big * 2 + (big + 2) * 4 + (big + 4)) / 7,
                                  "num_items": 5.0, "only": (7.5 + 3.5) / 2}


def test_scalars_detach_only_what_holds_a_graph() -> None:
    leaf = torch.tensor(2.0, requires_grad=True)
    plain = torch.tensor(3.0)
    values = averaging.scalars({"loss": leaf * 1, "norm": plain, "list": torch.ones(2),
                                "flag": True, "name": "x", "step": 4})
    assert [key for key, _ in values] == ["loss", "norm", "step"]
    assert not values[0][1].requires_grad  # type: ignore[union-attr]
    assert values[1][1] is plain and values[2][1] == 4


def test_ranks_confirm_agreed_keys_in_the_all_reduce_and_gather_only_when_they_change(
        tmp_path: Path) -> None:
    check(torchrun(REPO / "tests/scripts/averaging_run.py", [str(tmp_path)], timeout=120))
    runs = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    # Weights 2 (rank 0) and 3 (rank 1): loss (2*1 + 3*2) / 5, norm (2*10 + 3*20) / 5.
    both = {"loss": 1.6, "norm": 16.0}
    expected = [both, both, {**both, "extra": 7.0}, both, {"loss": 1.6, "norm": 20.0}]
    # A gather at the first step and whenever the ranks' keys together change (a key
    # appears, then goes); none while they stay what the ranks last agreed on.
    gathers = [1, 0, 1, 1, 0]
    agreed = [["loss", "norm"], ["loss", "norm"], ["extra", "loss", "norm"], ["loss", "norm"],
              ["loss", "norm"]]
    for rank, steps in enumerate(runs):
        for index, step in enumerate(steps):
            assert step["checked"] == step["gathered"], (rank, index)  # exactly, float for float
            assert step["checked"] == pytest.approx(expected[index], rel=1e-12), (rank, index)
            assert (step["gathers"], step["agreed"]) == (gathers[index], agreed[index])
