"""dream_trainer.optim: weight-decay groups and the warmup-then-decay schedule (exactly
transformers' schedules), its run length read from the trainer."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn
from transformers import (get_cosine_schedule_with_warmup,
                          get_cosine_with_min_lr_schedule_with_warmup,
                          get_linear_schedule_with_warmup)

from dream_trainer.optim import warmup_decay_schedule, weight_decay_groups
from tests.helpers.toy import ToyTrainer, toy_config


class ScaleNorm(nn.Module):  # not a torch norm: known by its name, as LlamaRMSNorm is
    def __init__(self) -> None:
        super().__init__()
        self.gain = nn.Parameter(torch.ones(4, 4))


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.proj = nn.Linear(4, 4)
        self.norm = nn.LayerNorm(4)
        self.scale = ScaleNorm()
        self.head = nn.Linear(4, 10, bias=False)
        self.head.weight = self.embed.weight  # tied
        self.temperature = nn.Parameter(torch.ones(()))
        self.frozen = nn.Linear(4, 4)
        self.frozen.requires_grad_(False)


def test_weight_decay_groups_follow_the_stated_rule() -> None:
    model = Tiny()
    decayed, rest = weight_decay_groups(model, 0.1)
    assert decayed["weight_decay"] == 0.1 and rest["weight_decay"] == 0.0
    assert [id(p) for p in decayed["params"]] == [id(model.embed.weight), id(model.proj.weight)]
    assert {id(p) for p in rest["params"]} == {
        id(model.proj.bias), id(model.norm.weight), id(model.norm.bias), id(model.scale.gain),
        id(model.temperature)}
    # Every trainable parameter exactly once; the frozen ones in neither group.
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert len(decayed["params"]) + len(rest["params"]) == len(trainable)
    torch.optim.AdamW(weight_decay_groups(model, 0.1), lr=1e-3)  # accepted as is


def learning_rates(make: Callable[[torch.optim.Optimizer], Any], steps: int) -> list[float]:
    optimizer = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.3)
    schedule = make(optimizer)
    rates = []
    for _ in range(steps):
        rates.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        schedule.step()
    return rates


@pytest.mark.parametrize(("warmup", "total"), [(5, 50), (0, 20), (3, 7), (10, 10)])
def test_the_schedules_equal_transformers_value_for_value(warmup: int, total: int) -> None:
    pairs = [
        (lambda o: get_cosine_schedule_with_warmup(o, warmup, total),
         lambda o: warmup_decay_schedule(o, warmup, total, "cosine")),
        (lambda o: get_linear_schedule_with_warmup(o, warmup, total),
         lambda o: warmup_decay_schedule(o, warmup, total, "linear")),
        (lambda o: get_cosine_with_min_lr_schedule_with_warmup(o, warmup, total,
                                                               min_lr_rate=0.1),
         lambda o: warmup_decay_schedule(o, warmup, total, "cosine", min_lr_ratio=0.1)),
    ]
    for theirs, ours in pairs:
        assert learning_rates(ours, total + 3) == learning_rates(theirs, total + 3)


def test_hand_values_at_the_milestones() -> None:
    rates = learning_rates(lambda o: warmup_decay_schedule(o, 4, 12, "linear", 0.5), 13)
    assert rates[:5] == pytest.approx([0.0, 0.075, 0.15, 0.225, 0.3])  # 0.3 x step / 4
    assert rates[8] == pytest.approx(0.3 * (0.5 + 0.5 * 0.5))  # halfway down, floor 0.5
    assert rates[12] == pytest.approx(0.15)  # the floor at total_steps
    constant = learning_rates(lambda o: warmup_decay_schedule(o, 2, 5, "constant"), 6)
    assert constant == pytest.approx([0.0, 0.15, 0.3, 0.3, 0.3, 0.3])


def test_bad_arguments_are_named() -> None:
    optimizer = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.3)
    with pytest.raises(ValueError, match="total_steps=3 is less than warmup_steps=5"):
        warmup_decay_schedule(optimizer, 5, 3)
    with pytest.raises(ValueError, match="decay='step'"):
        warmup_decay_schedule(optimizer, 0, 3, "step")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="min_lr_ratio must be in"):
        warmup_decay_schedule(optimizer, 0, 3, min_lr_ratio=2.0)


class Scheduled(ToyTrainer):
    def configure_schedulers(self) -> None:
        # The run's length is planned after this hook: read lazily.
        self.scheduler = warmup_decay_schedule(self.optimizer, 2, lambda: self.total_train_steps,
                                               "linear")

    def post_train_batch(self, result: dict[str, Any], batch_idx: int) -> None:
        if not self.is_accumulating_gradients:
            self.rates = [*getattr(self, "rates", []), self.optimizer.param_groups[0]["lr"]]


def test_the_run_length_comes_from_the_trainer() -> None:
    trainer = Scheduled(toy_config(n_samples=80, n_epochs=2, max_steps=15))
    with pytest.raises(RuntimeError, match="total_train_steps is known once the setup phase"):
        trainer.total_train_steps
    trainer.fit()
    assert trainer.total_train_steps == 15  # 10 a epoch x 2, cut at max_steps
    # lr after step s (the next step's): warmup to 1e-2 at 2, down to 0 at 15.
    expected = [1e-2 * s / 2 if s < 2 else 1e-2 * (15 - s) / 13 for s in range(1, 16)]
    assert trainer.rates == pytest.approx(expected, abs=1e-12)
