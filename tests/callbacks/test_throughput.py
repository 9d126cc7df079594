"""Throughput: exact rates under a fake clock, token counting, MFU and logging."""

from __future__ import annotations

import math
import time
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader

from dream_trainer.callbacks import Callback
from dream_trainer.callbacks.throughput import Throughput
from dream_trainer.configs import DeviceParameters
from dream_trainer.utils.memory import process_rss_bytes
from tests.helpers.toy import (RecordingLogger, ToyTrainer, logged_toy_config, toy_config,
                               toy_dataset)


class FakeClock(Callback):
    """Replaces ``time.perf_counter``: training micro-batches take ``seconds_per_batch``,
    validation batches ``seconds_per_val_batch``; nothing else takes time."""

    def __init__(self, seconds_per_batch: float, seconds_per_val_batch: float = 0.0) -> None:
        self.now = 1000.0
        self.seconds_per_batch = seconds_per_batch
        self.seconds_per_val_batch = seconds_per_val_batch

    def __call__(self) -> float:
        return self.now

    def pre_train_batch(self, batch: Any, batch_idx: int) -> None:
        self.now += self.seconds_per_batch

    def pre_val_batch(self, batch: Any, batch_idx: int) -> None:
        self.now += self.seconds_per_val_batch


class Logging(ToyTrainer, RecordingLogger):
    """A trainer with a logger mixin, whose ``log_dict`` records what is logged."""


def fit(monkeypatch: pytest.MonkeyPatch, throughput: Throughput, clock: FakeClock,
        trainer_class: type[ToyTrainer] = ToyTrainer, **config: Any) -> ToyTrainer:
    monkeypatch.setattr(time, "perf_counter", clock)
    make_config = logged_toy_config if issubclass(trainer_class, RecordingLogger) else toy_config
    # The expected memory keys are the CPU's: on a machine with a GPU too, only a test that
    # asks for CUDA gets it.
    config.setdefault("device_parameters", DeviceParameters(device="cpu"))
    trainer = trainer_class(make_config(callbacks=[clock, throughput], **config))
    trainer.fit()
    return trainer


def test_rates_and_mfu_are_exact_and_exclude_validation(monkeypatch: pytest.MonkeyPatch) -> None:
    throughput = Throughput(flops_per_sample=1e6, peak_flops=1e8, window=3, tokens_per_sample=10)
    # Two micro-batches of 8 samples per optimizer step, 0.25 s each; validation takes 60 s
    # a batch and must not count.
    fit(monkeypatch, throughput, FakeClock(0.25, seconds_per_val_batch=60.0), n_epochs=2,
        n_samples=64, gradient_accumulation_steps=2, val_every_n_steps=3)
    assert throughput.latest == {
        "throughput/step_time": 0.5,
        "throughput/samples_per_second": 32.0,
        "throughput/tokens_per_second": 320.0,
        "throughput/mfu": 1e6 * 32.0 / 1e8,
    }


def test_the_window_slides_over_the_latest_steps(monkeypatch: pytest.MonkeyPatch) -> None:
    class SlowingClock(FakeClock):
        def pre_train_batch(self, batch: Any, batch_idx: int) -> None:
            self.now += 1.0 + batch_idx  # 1 s, 2 s, 3 s, ... per step

    throughput = Throughput(window=2)
    fit(monkeypatch, throughput, SlowingClock(0.0), n_samples=40)
    # Steps 4 and 5 took 4 s and 5 s.
    assert throughput.latest == {"throughput/step_time": 4.5,
                                 "throughput/samples_per_second": 16 / 9}
    assert throughput.step_times == [4.0, 5.0]


class DictBatches(ToyTrainer):
    """Batches are dicts with an ``input_ids`` tensor of 5 token ids per sample."""

    def configure_dataloaders(self) -> tuple[DataLoader[Any], DataLoader[Any]]:
        x, y = toy_dataset(self.config.n_samples, self.config, seed=1).tensors
        samples = [{"x": x[i], "y": y[i], "input_ids": torch.arange(5)} for i in range(len(x))]
        batch_size = self.config.training_parameters.train_batch_size
        return DataLoader(samples, batch_size=batch_size), DataLoader(samples[:8], batch_size)

    def training_step(self, batch: Any, batch_idx: int) -> dict[str, Any]:
        return super().training_step((batch["x"], batch["y"]), batch_idx)

    def validation_step(self, batch: Any, batch_idx: int) -> dict[str, Any]:
        return super().validation_step((batch["x"], batch["y"]), batch_idx)


def test_tokens_are_counted_from_input_ids(monkeypatch: pytest.MonkeyPatch) -> None:
    throughput = Throughput()
    fit(monkeypatch, throughput, FakeClock(0.25), DictBatches, n_samples=32,
        gradient_accumulation_steps=2)
    # 2 micro-batches of 8 samples x 5 tokens in 0.5 s.
    assert throughput.latest["throughput/tokens_per_second"] == 2 * 8 * 5 / 0.5
    assert "throughput/mfu" not in throughput.latest


def test_no_tokens_and_no_flops_means_no_such_keys(monkeypatch: pytest.MonkeyPatch) -> None:
    throughput = Throughput(flops_per_sample=1e6)
    fit(monkeypatch, throughput, FakeClock(0.5), n_samples=16)
    assert set(throughput.latest) == {"throughput/step_time", "throughput/samples_per_second"}


def test_a_clock_that_does_not_move_gives_nan_not_an_error(
        monkeypatch: pytest.MonkeyPatch) -> None:
    throughput = Throughput()
    fit(monkeypatch, throughput, FakeClock(0.0), n_samples=16)
    assert throughput.latest["throughput/step_time"] == 0.0
    assert math.isnan(throughput.latest["throughput/samples_per_second"])


def test_values_are_logged_every_window_steps(monkeypatch: pytest.MonkeyPatch) -> None:
    trainer = fit(monkeypatch, Throughput(window=3), FakeClock(0.5), Logging, n_samples=64)
    assert [step for _, step in trainer.logged] == [3, 6]  # type: ignore[attr-defined]
    logged = trainer.logged[0][0]  # type: ignore[attr-defined]
    # One rank: the spread of busy times is its own step time (the fake clock sees no wait).
    assert {key: value for key, value in logged.items() if key.startswith("throughput/")} == {
        "throughput/step_time": 0.5, "throughput/samples_per_second": 16.0,
        "throughput/busy_time_min": 0.5, "throughput/busy_time_median": 0.5,
        "throughput/busy_time_max": 0.5, "throughput/slowest_rank": 0.0}
    # Memory comes along; the CUDA peaks only on CUDA.
    assert {key for key in logged if not key.startswith("throughput/")} == {"memory/rss_gib"}


def test_memory_is_the_process_rss(monkeypatch: pytest.MonkeyPatch) -> None:
    throughput = Throughput(window=2)
    fit(monkeypatch, throughput, FakeClock(0.5), Logging, n_samples=64)
    rss = process_rss_bytes()
    assert rss is not None
    assert set(throughput.memory) == {"memory/rss_gib"}
    # The process's RSS a moment later: the same within what a few steps allocate.
    assert throughput.memory["memory/rss_gib"] == pytest.approx(rss / 2**30, rel=0.2)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_peaks_are_logged_on_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    throughput = Throughput(window=2)
    trainer = fit(monkeypatch, throughput, FakeClock(0.5), Logging, n_samples=64,
                  device_parameters=DeviceParameters(device="cuda"))
    assert trainer.world.device.type == "cuda"
    logged = trainer.logged[0][0]  # type: ignore[attr-defined]
    allocated = logged["memory/cuda_allocated_peak_gib"]
    assert 0 < allocated <= logged["memory/cuda_reserved_peak_gib"]


@pytest.mark.parametrize("kwargs", [{"window": 0}, {"flops_per_sample": 0.0},
                                    {"peak_flops": -1.0}, {"tokens_per_sample": 0}])
def test_invalid_settings_are_rejected(kwargs: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        Throughput(**kwargs)
