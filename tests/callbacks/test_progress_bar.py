"""ProgressBar: plain lines for logs (exact format and values), rich bars on a terminal."""

from __future__ import annotations

import io
import re
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from dream_trainer.callbacks import Callback
from dream_trainer.callbacks.progress_bar import ProgressBar
from dream_trainer.configs import DeviceParameters, LoggingParameters
from dream_trainer.mixins import JSONLoggerMixin
from dream_trainer.utils.memory import process_rss_bytes
from tests.helpers.launch import REPO, check, child_env, torchrun
from tests.helpers.toy import LoggedToyConfig, ToyTrainer, toy_config


class FakeClock(Callback):
    """Replaces ``time.perf_counter``: time moves only when a training micro-batch starts,
    and (optionally) when a validation batch starts. Records what the bar should show."""

    def __init__(self, seconds_per_batch: float, seconds_per_val_batch: float = 0.0) -> None:
        self.now = 1000.0
        self.seconds_per_batch = seconds_per_batch
        self.seconds_per_val_batch = seconds_per_val_batch
        self.losses: list[float] = []
        self.val_results: list[dict[str, Any]] = []

    def __call__(self) -> float:
        return self.now

    def pre_train_batch(self, batch: Any, batch_idx: int) -> None:
        self.now += self.seconds_per_batch

    def post_train_batch(self, result: dict[str, Any], batch_idx: int) -> None:
        if "loss" in result:
            self.losses.append(float(result["loss"].detach()))

    def pre_val_batch(self, batch: Any, batch_idx: int) -> None:
        self.now += self.seconds_per_val_batch

    def post_val_epoch(self, result: dict[str, Any]) -> None:
        if not self.trainer.sanity_checking:
            self.val_results.append(result)


def fit_plain(monkeypatch: pytest.MonkeyPatch, bar: ProgressBar, clock: FakeClock,
              trainer_class: type[ToyTrainer] = ToyTrainer, **config: Any) -> list[str]:
    monkeypatch.setattr(time, "perf_counter", clock)
    # The expected lines are the CPU's (rss): on a machine with a GPU too, only a test that
    # asks for CUDA gets it.
    config.setdefault("device_parameters", DeviceParameters(device="cpu"))
    trainer_class(toy_config(callbacks=[clock, bar], **config)).fit()
    output = bar.stream.getvalue()  # type: ignore[attr-defined]
    assert "\x1b" not in output and "\r" not in output
    return output.splitlines()


# On the CPU every refresh ends with the process's resident set size.
RSS = r" rss \d+\.\d\d GiB"


def ema(values: list[float], smoothing: float) -> list[float]:
    averages = [values[0]]
    for value in values[1:]:
        averages.append(averages[-1] + smoothing * (value - averages[-1]))
    return averages


def test_plain_lines_have_the_exact_format_and_values(monkeypatch: pytest.MonkeyPatch) -> None:
    # 64 samples in micro-batches of 8, two per optimizer step: 4 steps per epoch, 12 in all.
    clock = FakeClock(seconds_per_batch=0.25, seconds_per_val_batch=30.0)
    bar = ProgressBar(refresh_every_n_steps=2, smoothing=0.1, stream=io.StringIO())
    lines = fit_plain(monkeypatch, bar, clock, n_epochs=3, n_samples=64,
                      gradient_accumulation_steps=2)

    step_losses = [(a + b) / 2 for a, b in zip(clock.losses[::2], clock.losses[1::2])]
    smoothed = ema(step_losses, 0.1)
    expected_val = iter(f"validation epoch {epoch}: val_loss={result['val_loss']:.4f}"
                        for epoch, result in enumerate(clock.val_results, start=1))
    assert len(lines) == 6 + 3
    for step in range(2, 13, 2):
        line = lines.pop(0)
        epoch = (step - 1) // 4 + 1
        # 16 samples per 0.5 s step; validation time (30 s a batch) is not training time.
        match = re.fullmatch(rf"epoch {epoch}/3 step {step}/12 loss_ema (\d+\.\d{{4}}) "
                             rf"32\.0 samples/s eta 0:00:0{(12 - step) // 2}{RSS}", line)
        assert match, line
        # Printed to 4 decimals: an absolute rounding (at most 5e-5) on every CPU, beside
        # which float32's is nothing (the same below).
        assert float(match.group(1)) == pytest.approx(smoothed[step - 1], abs=1e-4)
        if step % 4 == 0:
            assert lines.pop(0) == next(expected_val)
    assert lines == []


def test_the_loss_is_labelled_as_smoothed_unless_it_is_the_steps_own(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # Two micro-batches a step: the step's loss is their mean, which a logger writes too.
    clock = FakeClock(seconds_per_batch=0.25)
    bar = ProgressBar(refresh_every_n_steps=1, smoothing=1.0, stream=io.StringIO())
    lines = fit_plain(monkeypatch, bar, clock, n_samples=32, gradient_accumulation_steps=2)
    step_losses = [(a + b) / 2 for a, b in zip(clock.losses[::2], clock.losses[1::2])]
    shown = [re.search(r" loss (\d+\.\d{4}) ", line) for line in lines
             if line.startswith("epoch")]
    assert [float(match.group(1)) for match in shown if match] \
        == pytest.approx(step_losses, abs=1e-4)
    assert len(shown) == len(step_losses) == 2 and "loss_ema" not in "".join(lines)
    # Smoothed, the value is no step's loss, and the label says so.
    clock = FakeClock(seconds_per_batch=0.25)
    bar = ProgressBar(refresh_every_n_steps=1, smoothing=0.5, stream=io.StringIO())
    lines = fit_plain(monkeypatch, bar, clock, n_samples=32, gradient_accumulation_steps=2)
    step_losses = [(a + b) / 2 for a, b in zip(clock.losses[::2], clock.losses[1::2])]
    last = re.search(r" loss_ema (\d+\.\d{4}) ", lines[1])
    assert last and float(last.group(1)) == pytest.approx(ema(step_losses, 0.5)[1], abs=1e-4)
    assert " loss " not in "".join(lines)


def test_max_steps_sets_the_totals_and_the_last_step_refreshes(
        monkeypatch: pytest.MonkeyPatch) -> None:
    clock = FakeClock(seconds_per_batch=1.0)
    bar = ProgressBar(refresh_every_n_steps=4, stream=io.StringIO())
    lines = fit_plain(monkeypatch, bar, clock, n_epochs=5, n_samples=32, max_steps=6)
    progress = [line.split(" loss_ema ")[0] for line in lines if line.startswith("epoch")]
    assert progress == ["epoch 1/2 step 4/6", "epoch 2/2 step 6/6"]
    assert lines[-1].startswith("validation epoch 2: val_loss=")
    assert re.search(rf" 8\.0 samples/s eta 0:00:02{RSS}$", lines[0])


def test_by_default_the_display_refreshes_by_time_not_every_step(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # 0.4 s a step, refreshes at least 1 s apart: the first step, then every third, and the
    # last (8 steps). A fast loop is not held up by a host sync every step.
    bar = ProgressBar(stream=io.StringIO())
    lines = fit_plain(monkeypatch, bar, FakeClock(0.4), n_samples=64)
    steps = [int(re.search(r"step (\d+)/8", line).group(1))  # type: ignore[union-attr]
             for line in lines if line.startswith("epoch")]
    assert steps == [1, 4, 7, 8]
    assert ProgressBar(refresh_seconds=0.0).refresh_seconds == 0.0


def test_mid_epoch_validation_names_its_step_and_sanity_checks_are_silent(
        monkeypatch: pytest.MonkeyPatch) -> None:
    bar = ProgressBar(refresh_every_n_steps=100, stream=io.StringIO())
    lines = fit_plain(monkeypatch, bar, FakeClock(0.1), n_samples=32, val_every_n_steps=2,
                      num_sanity_val_steps=1)
    validations = [line.split(":")[0] for line in lines if line.startswith("validation")]
    assert validations == ["validation epoch 1 step 2", "validation epoch 1 step 4"]


def test_results_without_a_loss_show_speed_only(monkeypatch: pytest.MonkeyPatch) -> None:
    class NoLoss(ToyTrainer):
        def training_step(self, batch: Any, batch_idx: int) -> dict[str, Any]:
            x, y = batch
            self.backward(F.mse_loss(self.model(x), y))
            self.step(self.model, self.optimizer)
            return {}

    bar = ProgressBar(stream=io.StringIO())
    lines = fit_plain(monkeypatch, bar, FakeClock(0.5), NoLoss, n_samples=16)
    assert re.fullmatch(rf"epoch 1/1 step 1/2 16\.0 samples/s eta 0:00:00{RSS}", lines[0])
    assert re.fullmatch(rf"epoch 1/1 step 2/2 16\.0 samples/s eta 0:00:00{RSS}", lines[1])


def test_memory_is_the_process_rss_on_the_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    bar = ProgressBar(refresh_every_n_steps=1, stream=io.StringIO())
    lines = fit_plain(monkeypatch, bar, FakeClock(0.5), n_samples=16)
    shown = float(re.search(r" rss (\d+\.\d\d) GiB$", lines[-2]).group(1))  # type: ignore[union-attr]
    rss = process_rss_bytes()
    assert rss is not None and "mem " not in lines[-2]  # no CUDA peaks off CUDA
    # A moment later, the same within what the last validation pass allocated.
    assert shown == pytest.approx(rss / 2**30, rel=0.2, abs=0.01)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_memory_is_the_allocator_peaks_on_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    bar = ProgressBar(refresh_every_n_steps=1, stream=io.StringIO())
    lines = fit_plain(monkeypatch, bar, FakeClock(0.5), n_samples=16,
                      device_parameters=DeviceParameters(device="cuda"))
    match = re.search(r" mem (\d+\.\d\d)/(\d+\.\d\d) GiB$", lines[-2])
    assert match and " rss " not in lines[-2], lines
    assert float(match.group(1)) <= float(match.group(2))


@pytest.mark.parametrize("kwargs", [{"refresh_every_n_steps": 0}, {"smoothing": 0.0},
                                    {"smoothing": 1.5}, {"refresh_seconds": -1.0}])
def test_invalid_settings_are_rejected(kwargs: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        ProgressBar(**kwargs)


def test_importing_the_display_callbacks_loads_no_rich() -> None:
    code = ("import sys, dream_trainer.callbacks.progress_bar, dream_trainer.callbacks.summaries\n"
            "print(sorted(name for name in sys.modules if name.startswith('rich')))")
    result = subprocess.run([sys.executable, "-c", code], env=child_env(), cwd=REPO,
                            capture_output=True, text=True, timeout=120, check=True)
    assert result.stdout.strip() == "[]"


class FakeTerminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_terminal_gets_rich_bars_and_stdout_is_restored() -> None:
    stream = FakeTerminal()
    stdout = sys.stdout
    ToyTrainer(toy_config(n_epochs=2, n_samples=32, callbacks=[ProgressBar(stream=stream)])).fit()
    output = stream.getvalue()
    assert "\x1b" in output
    assert "epoch 2/2" in output and "8/8" in output and "samples/s" in output
    assert "validation epoch 2: val_loss=" in output
    assert sys.stdout is stdout


SCRIPT = """
import time
from dream_trainer.callbacks.progress_bar import ProgressBar
from dream_trainer.configs import DeviceParameters
from tests.callbacks.test_progress_bar import FakeClock
from tests.helpers.toy import ToyTrainer, toy_config

clock = FakeClock(seconds_per_batch=0.5)
time.perf_counter = clock
ToyTrainer(toy_config(n_samples=64, device_parameters=DeviceParameters.DDP(device="cpu"),
                      callbacks=[clock, ProgressBar(refresh_every_n_steps=2)])).fit()
"""


@pytest.mark.distributed
def test_only_rank_zero_prints_and_samples_count_every_rank(tmp_path: Path) -> None:
    script = tmp_path / "progress.py"
    script.write_text(textwrap.dedent(SCRIPT))
    output = check(torchrun(script)).stdout
    lines = [line for line in output.splitlines() if line.startswith(("epoch", "validation"))]
    # 64 samples over 2 ranks in batches of 8: 4 steps of 16 samples, 0.5 s each.
    assert [line.split(" loss_ema ")[0] for line in lines[:2]] == ["epoch 1/1 step 2/4",
                                                                   "epoch 1/1 step 4/4"]
    assert re.search(rf" 32\.0 samples/s eta 0:00:01{RSS}$", lines[0])
    assert len(lines) == 3 and lines[2].startswith("validation epoch 1: val_loss=")


class CountedLoss(torch.Tensor):
    """A loss that counts the torch operations run on it."""

    operations = 0

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        cls.operations += 1
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **(kwargs or {}))


class CountLossOperations(Callback):
    """Listed on both sides of the bar: before it, it hands the bar a counted loss; after it,
    it records how many operations the bar ran on that loss."""

    def __init__(self, counts: list[int] | None = None) -> None:
        self.counts = counts

    def post_train_batch(self, result: dict[str, Any], batch_idx: int) -> None:
        if self.counts is None:
            result["loss"] = result["loss"].detach().as_subclass(CountedLoss)
            CountedLoss.operations = 0
        else:
            self.counts.append(CountedLoss.operations)


class LoggedToy(ToyTrainer, JSONLoggerMixin):
    pass


def test_with_a_logger_the_bar_runs_no_tensor_op_between_logged_steps(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    # Every second step is logged (reduced over the step): from the first on, the bar shows
    # those values and leaves the other steps' losses alone.
    counts: list[int] = []
    clock = FakeClock(seconds_per_batch=0.25)
    bar = ProgressBar(refresh_every_n_steps=1, smoothing=1.0, stream=io.StringIO())
    monkeypatch.setattr(time, "perf_counter", clock)
    config = LoggedToyConfig(
        **dict(toy_config(n_samples=48, device_parameters=DeviceParameters(device="cpu"),
                          callbacks=[clock, CountLossOperations(), bar,
                                     CountLossOperations(counts)])),
        logging_parameters=LoggingParameters(log_dir=tmp_path, log_every_n_steps=2))
    LoggedToy(config).fit()
    assert len(counts) == 6
    assert counts[0] > 0 and counts[1:] == [0] * 5
    # The lines show each logged step's loss (smoothing=1), and step 1's own.
    shown = [float(m.group(1)) for line in bar.stream.getvalue().splitlines()  # type: ignore[attr-defined]
             if (m := re.search(r" loss (\d+\.\d{4}) ", line))]
    assert len(shown) == 6
    assert shown[0] == pytest.approx(clock.losses[0], abs=1e-4)
    assert shown[1::2] == pytest.approx(clock.losses[1::2], abs=1e-4)
    assert shown[2::2] == shown[1:5:2]  # steps 3 and 5 keep the last logged value
