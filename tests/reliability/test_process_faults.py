"""Bad user code and failing ranks end with clear errors, never hangs."""

from __future__ import annotations

import subprocess
import sys
import time
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from tests.helpers.launch import REPO, child_env, outputs_of, spawn_ranks, torchrun
from tests.helpers.toy import ToyTrainer, toy_config

FAILURE_SCRIPT = REPO / "tests/scripts/rank_failure.py"


@pytest.mark.distributed
def test_one_failing_rank_brings_both_down_quickly_naming_the_rank() -> None:
    start = time.monotonic()
    procs = spawn_ranks(FAILURE_SCRIPT)
    outputs = outputs_of(procs, timeout=60)
    elapsed = time.monotonic() - start
    codes = [proc.returncode for proc in procs]
    assert all(code != 0 for code in codes), (codes, outputs)
    assert elapsed < 60
    assert "fit() failed on rank 1 of 2" in outputs[1]
    assert "injected failure in training_step" in outputs[1]
    # Rank 0 sees its peer vanish inside a collective and fails too, instead of waiting.
    assert "fit() failed on rank 0 of 2" in outputs[0]
    assert all("finished without error" not in out for out in outputs)


@pytest.mark.distributed
def test_under_torchrun_the_job_fails_and_reports_the_rank() -> None:
    start = time.monotonic()
    result = torchrun(FAILURE_SCRIPT, timeout=60)
    assert result.returncode != 0
    assert time.monotonic() - start < 60
    assert "fit() failed on rank 1 of 2" in result.stderr + result.stdout
    assert "finished without error" not in result.stdout


class EmptyData(ToyTrainer):
    def configure_dataloaders(self) -> tuple[Any, Any]:
        empty = TensorDataset(torch.zeros(0, 8), torch.zeros(0, 4))
        return DataLoader(empty, batch_size=8), None


def test_empty_train_loader_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="the train dataloader is empty"):
        EmptyData(toy_config()).fit()


def test_loader_shorter_than_the_accumulation_window_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="2 batches per rank, fewer than "
                                         "gradient_accumulation_steps=4"):
        ToyTrainer(toy_config(n_samples=16, gradient_accumulation_steps=4)).fit()


def test_iterable_loader_without_length_needs_steps_per_epoch() -> None:
    class Stream(ToyTrainer):
        def configure_dataloaders(self) -> tuple[Any, Any]:
            batch = (torch.zeros(8, 8), torch.zeros(8, 4))
            return (batch for _ in range(3)), None

    with pytest.raises(ValueError, match="set training_parameters.train_steps_per_epoch"):
        Stream(toy_config()).fit()


def test_training_step_must_return_a_dict() -> None:
    class NoDict(ToyTrainer):
        def training_step(self, batch: Any, batch_idx: int) -> Any:
            super().training_step(batch, batch_idx)
            return None

    with pytest.raises(TypeError, match="training_step must return a dict"):
        NoDict(toy_config()).fit()


def test_step_while_accumulating_is_refused() -> None:
    class Eager(ToyTrainer):
        def training_step(self, batch: Any, batch_idx: int) -> dict[str, Any]:
            x, y = batch
            self.backward(torch.nn.functional.mse_loss(self.model(x), y))
            self.step(self.model, self.optimizer)
            return {}

    with pytest.raises(RuntimeError, match="step\\(\\) called on micro-batch 0, which is "
                                           "still accumulating"):
        Eager(toy_config(gradient_accumulation_steps=2)).fit()


def test_a_tensor_no_initializer_touches_is_named() -> None:
    class WithTable(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(8, 4)
            self.register_buffer("table", torch.arange(4.0), persistent=False)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.linear(x) + self.table

    class Forgetful(ToyTrainer):
        def configure_models(self) -> None:
            self.model = WithTable()

    with pytest.raises(RuntimeError, match="model.table \\(not initialized: NaN or inf\\)"):
        Forgetful(toy_config()).fit()

    class Careful(Forgetful):
        def init_weights(self) -> None:
            self.model.table.copy_(torch.arange(4.0))

    trainer = Careful(toy_config(n_samples=8))
    trainer.fit()
    assert torch.equal(trainer.model.table, torch.arange(4.0))


def test_trainer_without_models_or_optimizers_is_told_what_to_do() -> None:
    class NoModel(ToyTrainer):
        def configure_models(self) -> None:
            pass

    with pytest.raises(ValueError, match="configure_models\\(\\) assigned no nn.Module"):
        NoModel(toy_config()).fit()

    class NoOptimizer(ToyTrainer):
        def configure_optimizers(self) -> None:
            pass

    with pytest.raises(ValueError, match="configure_optimizers\\(\\) created no optimizer"):
        NoOptimizer(toy_config()).fit()


def test_single_device_config_under_two_ranks_fails_before_any_collective() -> None:
    code = ("from dream_trainer.configs import DeviceParameters\n"
            "from tests.helpers.toy import ToyTrainer, toy_config\n"
            "ToyTrainer(toy_config(device_parameters=DeviceParameters.SINGLE_DEVICE()))\n")
    env = {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": "1"}
    result = subprocess.run([sys.executable, "-c", code], env=child_env(env), capture_output=True,
                            text=True, timeout=60, cwd=REPO)
    assert result.returncode != 0
    assert "MeshMismatchError: mesh" in result.stderr
    assert "has 1 ranks but the world size is 2" in result.stderr
