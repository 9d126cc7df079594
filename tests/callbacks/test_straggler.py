"""Throughput's straggler report: busy time per rank, its spread, the warning, one exchange
per logging window."""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.autograd import Variable

from dream_trainer.callbacks.throughput import Throughput
from dream_trainer.utils.stragglers import RankSpread, StragglerStreak
from tests.helpers.launch import REPO, check, torchrun
from tests.helpers.toy import RecordingLogger, ToyTrainer, logged_toy_config

SCRIPT = REPO / "tests" / "scripts" / "straggler_run.py"
SPREAD_KEYS = {"throughput/busy_time_min", "throughput/busy_time_median",
               "throughput/busy_time_max", "throughput/slowest_rank"}


class Logging(ToyTrainer, RecordingLogger):
    pass


# -- one process --------------------------------------------------------------------------------
def test_one_rank_reports_a_spread_of_one_without_a_collective(
        monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []
    for name in ("all_gather", "all_gather_into_tensor", "all_gather_object", "all_reduce",
                 "broadcast", "barrier", "gather"):
        monkeypatch.setattr(dist, name, lambda *a, _name=name, **k: calls.append(_name))
    throughput = Throughput(window=2)
    trainer = Logging(logged_toy_config(callbacks=[throughput], n_samples=48))
    trainer.fit()
    assert calls == []
    assert [step for _, step in trainer.logged] == [2, 4, 6]
    for values, _ in trainer.logged:
        assert SPREAD_KEYS <= set(values)
        assert values["throughput/slowest_rank"] == 0.0
        assert (values["throughput/busy_time_min"] == values["throughput/busy_time_median"]
                == values["throughput/busy_time_max"])
        assert 0 < values["throughput/busy_time_max"] <= values["throughput/step_time"]
    assert set(throughput.spread) == SPREAD_KEYS
    # The forward hooks that time the backward passes are gone after fit().
    assert not trainer.model._forward_hooks


class SynchronisingModel(nn.Module):
    """A linear model whose backward ends in a final callback that sleeps, as DDP's waits for
    the slowest rank's gradients."""

    def __init__(self, wait: float) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 4)
        self.wait = wait
        self._hooked = 0  # id() of the weight with the hook: setup replaces the meta weight

    def _queue_wait(self, parameter: torch.Tensor) -> None:
        Variable._execution_engine.queue_callback(lambda: time.sleep(self.wait))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if id(self.linear.weight) != self._hooked:
            self.linear.weight.register_post_accumulate_grad_hook(self._queue_wait)
            self._hooked = id(self.linear.weight)
        return self.linear(x)


class SynchronisingTrainer(ToyTrainer):
    wait = 0.05

    def configure_models(self) -> None:
        self.model = SynchronisingModel(self.wait)


def test_time_blocked_at_the_end_of_backward_is_not_busy_time() -> None:
    throughput = Throughput(window=3)
    SynchronisingTrainer(logged_toy_config(callbacks=[throughput], n_samples=24)).fit()
    step_time = throughput.latest["throughput/step_time"]
    # Each step slept `wait` in its backward's final callback: all of it is waiting.
    assert step_time >= SynchronisingTrainer.wait
    assert throughput.spread["throughput/busy_time_max"] <= step_time - SynchronisingTrainer.wait


@pytest.mark.parametrize("kwargs", [{"straggler_threshold": 0.0},
                                    {"straggler_threshold": -0.1},
                                    {"straggler_threshold": float("nan")},
                                    {"straggler_windows": 0}, {"straggler_windows": 2.5},
                                    {"straggler_windows": True}])
def test_invalid_straggler_settings_are_rejected(kwargs: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        Throughput(**kwargs)


def test_the_spread_names_the_busiest_rank() -> None:
    spread = RankSpread((0.010, 0.050, 0.012))
    assert spread.metrics() == {"throughput/busy_time_min": 0.010,
                                "throughput/busy_time_median": 0.012,
                                "throughput/busy_time_max": 0.050,
                                "throughput/slowest_rank": 1.0}
    assert spread.excess == pytest.approx(0.050 / 0.012 - 1)
    assert RankSpread((0.02, 0.02)).slowest == 0  # a tie names the lowest rank
    assert RankSpread((0.0, 0.0, 0.1)).excess == 0.0  # a median of 0 flags nothing


def test_the_streak_warns_every_n_windows_of_the_same_rank() -> None:
    streak = StragglerStreak(threshold=0.2, windows=2)
    slow = {rank: RankSpread(tuple(0.2 if r == rank else 0.1 for r in range(3)))
            for rank in range(3)}
    even = RankSpread((0.11, 0.1, 0.1))  # 10 % over the median: under the threshold
    windows = [slow[1], slow[1], slow[1], slow[1], slow[2], slow[2], even, slow[2], slow[2]]
    assert [streak.update(spread) for spread in windows] == [
        False, True, False, True, False, True, False, False, True]
    assert (streak.rank, streak.length) == (2, 2)


# -- three ranks under DDP ----------------------------------------------------------------------
SLEEP = 0.2  # about 50x a step of the toy model: a loaded machine cannot hide it
WINDOW = 4
STEPS = 16


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    out = tmp_path_factory.mktemp("straggler")
    check(torchrun(SCRIPT, [str(out), "1", str(SLEEP), str(WINDOW), str(STEPS)], nproc=3))
    return [torch.load(out / f"rank{rank}.pt", weights_only=False) for rank in range(3)]


def test_one_all_gather_per_logging_window_on_every_rank(ranks: list[dict[str, Any]]) -> None:
    for seen in ranks:
        assert seen["global_step"] == STEPS
        assert seen["gathers"] == STEPS // WINDOW
    # Every rank holds the same exchanged figures; only rank 0 logs.
    assert ranks[0]["spread"] == ranks[1]["spread"] == ranks[2]["spread"]
    assert [step for _, step in ranks[0]["logged"]] == [4, 8, 12, 16]
    assert ranks[1]["logged"] == ranks[2]["logged"] == []


def test_the_sleeping_rank_is_the_slowest_in_every_window(ranks: list[dict[str, Any]]) -> None:
    for values, step in ranks[0]["logged"]:
        low, median, high = (values[f"throughput/busy_time_{k}"] for k in ("min", "median", "max"))
        assert values["throughput/slowest_rank"] == 1.0, (step, values)
        assert low <= median <= high
        # The sleep is rank 1's own work; every rank's step waits for it.
        assert high >= SLEEP
        assert values["throughput/step_time"] >= SLEEP


def test_rank_zero_warns_once_naming_the_straggler(ranks: list[dict[str, Any]]) -> None:
    # straggler_windows=3 over 4 windows: one warning, at the third.
    [line] = ranks[0]["warnings"]
    assert line.startswith("rank 1 is a straggler: busy ")
    assert "more than the median rank's" in line
    assert "for 3 logging windows in a row (to step 12" in line
    assert ranks[1]["warnings"] == ranks[2]["warnings"] == []
