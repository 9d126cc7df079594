"""Debugging switches of DeviceParameters: anomaly detection and the flight recorder size."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

from dream_trainer.callbacks import Callback
from dream_trainer.configs import DeviceParameters
from dream_trainer.world import DistributedWorld
from dream_trainer.world.environment import FLIGHT_RECORDER_SIZE
from tests.helpers.toy import ToyTrainer, toy_config


class AnomalyProbe(Callback):
    def __init__(self) -> None:
        self.seen: set[bool] = set()

    def post_train_batch(self, result: dict[str, Any], batch_idx: int) -> None:
        self.seen.add(torch.is_anomaly_enabled())


class NaNGradient(ToyTrainer):
    def training_step(self, batch: Any, batch_idx: int) -> dict[str, Any]:
        x, _ = batch
        # sqrt of a negative number: NaN forward and backward.
        loss = torch.sqrt(self.model(x).sum() * 0 - 1)
        self.backward(loss)
        return {"loss": loss}


def test_detect_anomaly_is_on_during_fit_only() -> None:
    probe = AnomalyProbe()
    ToyTrainer(toy_config(n_samples=16, callbacks=[probe],
                          device_parameters=DeviceParameters(detect_anomaly=True))).fit()
    assert probe.seen == {True}
    assert not torch.is_anomaly_enabled()
    plain = AnomalyProbe()
    ToyTrainer(toy_config(n_samples=16, callbacks=[plain])).fit()
    assert plain.seen == {False}


def test_detect_anomaly_names_the_operation_and_is_restored_after_a_failure() -> None:
    config = toy_config(n_samples=16, device_parameters=DeviceParameters(detect_anomaly=True))
    # Anomaly mode warns with the forward stack of the operation, then backward raises.
    with pytest.warns(UserWarning, match="Error detected in SqrtBackward0"), \
            pytest.raises(RuntimeError, match="'SqrtBackward0' returned nan values"):
        NaNGradient(config).fit()
    assert not torch.is_anomaly_enabled()


def test_a_setting_made_outside_is_kept() -> None:
    torch.autograd.set_detect_anomaly(True)
    try:
        ToyTrainer(toy_config(n_samples=16,
                              device_parameters=DeviceParameters(detect_anomaly=True))).fit()
        assert torch.is_anomaly_enabled()
    finally:
        torch.autograd.set_detect_anomaly(False)


def test_flight_recorder_entries_sets_torchs_variable_before_the_group_starts(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(FLIGHT_RECORDER_SIZE, raising=False)
    monkeypatch.setenv("TORCH_NCCL_TRACE_BUFFER_SIZE", "5")  # the old name, set by a user
    world = DistributedWorld(DeviceParameters(flight_recorder_entries=123))
    world.launch()
    try:
        assert os.environ[FLIGHT_RECORDER_SIZE] == "123"
        assert os.environ["TORCH_NCCL_TRACE_BUFFER_SIZE"] == "123"
    finally:
        world.shutdown()
    monkeypatch.delenv(FLIGHT_RECORDER_SIZE)
    untouched = DistributedWorld(DeviceParameters())
    untouched.launch()
    untouched.shutdown()
    assert FLIGHT_RECORDER_SIZE not in os.environ
