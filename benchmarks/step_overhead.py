"""Per-step overhead of the trainers against a hand-written PyTorch loop.

The same model, data, seed and optimizer are trained by (a) a hand-written loop, (b)
``BaseTrainer`` + ``SetupMixin``, (c) ``DreamTrainer`` with its default callbacks (progress
lines, LR monitor, JSON logs, checkpoints at the end). Each step's wall time is taken after a
warm-up; a trial reports the median step time of each variant, and the figures are the medians
(and spread) of the per-trial ratios to (a), so machine noise affects all variants alike.
(b) must end with weights identical to (a).

    python -m benchmarks.step_overhead [--model mlp|transformer] [--steps 300] [--trials 5]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from dream_trainer import BaseTrainer, BaseTrainerConfig, DreamTrainer, DreamTrainerConfig
from dream_trainer.configs import (CheckpointParameters, DeviceParameters, LoggingParameters,
                                   TrainingParameters)
from dream_trainer.mixins import SetupConfigMixin, SetupMixin

SEED, BATCH, WARMUP = 0, 32, 20


def build_model(kind: str) -> nn.Module:
    if kind == "mlp":
        return nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(),
                             nn.Linear(256, 10))
    layer = nn.TransformerEncoderLayer(64, 4, dim_feedforward=128, dropout=0.0,
                                       batch_first=True)
    return nn.Sequential(nn.TransformerEncoder(layer, num_layers=2), nn.Flatten(),
                         nn.Linear(64 * 16, 10))


def dataset(kind: str, steps: int) -> TensorDataset:
    generator = torch.Generator().manual_seed(1)
    shape = (64,) if kind == "mlp" else (16, 64)
    n = steps * BATCH
    return TensorDataset(torch.randn(n, *shape, generator=generator),
                         torch.randint(0, 10, (n,), generator=generator))


def hand_written(kind: str, steps: int) -> tuple[list[float], nn.Module]:
    """(a): plain PyTorch, with the same gradient-norm computation ``step()`` returns."""
    torch.manual_seed(SEED)
    model = build_model(kind)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    times = []
    model.train()
    for x, y in DataLoader(dataset(kind, steps), batch_size=BATCH):
        start = time.perf_counter()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        torch.nn.utils.get_total_norm([p.grad for p in model.parameters()], foreach=True)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - start)
    return times, model


class BenchConfig(BaseTrainerConfig, SetupConfigMixin):
    kind: str
    steps: int


class Timed:
    """Shared by (b) and (c): time each step from pre_train_batch to post_train_batch."""

    def configure_models(self) -> None:
        self.model = build_model(self.config.kind)  # type: ignore[attr-defined]

    def configure_optimizers(self) -> None:
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-3)

    def configure_dataloaders(self) -> tuple[DataLoader[Any], None]:
        config = self.config  # type: ignore[attr-defined]
        return DataLoader(dataset(config.kind, config.steps), batch_size=BATCH), None

    def training_step(self, batch: Any, batch_idx: int) -> dict[str, Any]:
        x, y = batch
        loss = F.cross_entropy(self.model(x), y)
        self.backward(loss)  # type: ignore[attr-defined]
        return {"loss": loss, "grad_norm": self.step(self.model, self.optimizer)}  # type: ignore[attr-defined]

    def validation_step(self, batch: Any, batch_idx: int) -> dict[str, Any]:
        return {}

    def pre_train_batch(self, batch: Any, batch_idx: int) -> None:
        super().pre_train_batch(batch, batch_idx)  # type: ignore[misc]
        self._start = time.perf_counter()

    def post_train_batch(self, result: dict[str, Any], batch_idx: int) -> None:
        super().post_train_batch(result, batch_idx)  # type: ignore[misc]
        self.times.append(time.perf_counter() - self._start)


class BaseBench(Timed, BaseTrainer, SetupMixin):
    times: list[float]


class DreamConfig(DreamTrainerConfig):
    kind: str
    steps: int


class DreamBench(Timed, DreamTrainer):
    times: list[float]


def run_trainer(trainer_class: type, config: Any) -> tuple[list[float], nn.Module]:
    trainer = trainer_class(config)
    trainer.times = []
    trainer.fit()
    return trainer.times, trainer.model


def measure(kind: str = "mlp", steps: int = 300, trials: int = 5) -> dict[str, Any]:
    ratios: dict[str, list[float]] = {"base": [], "dream": []}
    medians: dict[str, list[float]] = {"hand": [], "base": [], "dream": []}
    identical = True
    common = {"project": "bench", "group": "overhead", "experiment": kind, "seed": SEED,
              "kind": kind, "steps": steps,
              "device_parameters": DeviceParameters.SINGLE_DEVICE(),
              "training_parameters": TrainingParameters(n_epochs=1, train_batch_size=BATCH)}
    with tempfile.TemporaryDirectory() as tmp:
        for trial_index in range(trials):
            hand_times, hand_model = hand_written(kind, steps)
            base_times, base_model = run_trainer(BaseBench, BenchConfig(**common))
            dream_times, _ = run_trainer(DreamBench, DreamConfig(
                **common,
                checkpoint_parameters=CheckpointParameters(root_dir=Path(tmp) / str(trial_index)),
                logging_parameters=LoggingParameters(log_dir=Path(tmp) / str(trial_index))))
            identical &= all(torch.equal(a, b) for a, b in zip(hand_model.state_dict().values(),
                                                               base_model.state_dict().values()))
            trial = {name: statistics.median(times[WARMUP:]) for name, times in
                     (("hand", hand_times), ("base", base_times), ("dream", dream_times))}
            for name, value in trial.items():
                medians[name].append(value)
            ratios["base"].append(trial["base"] / trial["hand"])
            ratios["dream"].append(trial["dream"] / trial["hand"])
    return {
        "model": kind, "steps": steps, "trials": trials,
        "median_step_seconds": {k: statistics.median(v) for k, v in medians.items()},
        "ratio_to_hand": {k: statistics.median(v) for k, v in ratios.items()},
        "ratio_spread": {k: (min(v), max(v)) for k, v in ratios.items()},
        "base_weights_identical_to_hand": identical,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description="trainer step overhead benchmark")
    parser.add_argument("--model", choices=["mlp", "transformer"], default="mlp")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--trials", type=int, default=5)
    args = parser.parse_args()
    result = measure(args.model, args.steps, args.trials)
    print(result)


if __name__ == "__main__":
    main()
