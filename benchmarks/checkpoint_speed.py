"""Checkpoint speed: DCP through CheckpointMixin vs torch.save/torch.load of the same state,
and how long an async save blocks the training loop compared with a sync save.

Single process, CPU, the page cache as storage. Each figure is the median of ``--repeats``
runs; ratios are taken within the same run.

    python -m benchmarks.checkpoint_speed [--size-mb 256] [--repeats 5] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from dream_trainer import BaseTrainer, BaseTrainerConfig
from dream_trainer.checkpoint.state import TrainingState
from dream_trainer.configs import CheckpointParameters, DeviceParameters, TrainingParameters
from dream_trainer.mixins import (CheckpointConfigMixin, CheckpointMixin, SetupConfigMixin,
                                  SetupMixin)

WIDTH = 1024
LAYER_BYTES = (WIDTH * WIDTH + WIDTH) * 4


class BenchConfig(BaseTrainerConfig, SetupConfigMixin, CheckpointConfigMixin):
    layers: int


class BenchTrainer(BaseTrainer, SetupMixin, CheckpointMixin):
    """One AdamW step so the optimizer holds state; the measurements run in ``post_fit``."""

    config: BenchConfig

    def configure_models(self) -> None:
        self.model = nn.Sequential(*(nn.Linear(WIDTH, WIDTH) for _ in range(self.config.layers)))

    def configure_optimizers(self) -> None:
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-4)

    def configure_dataloaders(self) -> tuple[DataLoader[Any], None]:
        return DataLoader(TensorDataset(torch.randn(1, WIDTH)), batch_size=1), None

    def training_step(self, batch: Any, batch_idx: int) -> dict[str, Any]:
        (x,) = batch
        self.backward(self.model(x).square().mean())
        self.step(self.model, self.optimizer)
        return {}

    def validation_step(self, batch: Any, batch_idx: int) -> dict[str, Any]:
        return {}


def _time(fn: Any) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def measure(size_mb: int, repeats: int) -> dict[str, Any]:
    layers = max(1, round(size_mb * 2**20 / LAYER_BYTES / 3))  # weights + 2 Adam moments
    results: dict[str, list[float]] = {k: [] for k in ("dcp_save", "torch_save", "dcp_load",
                                                       "torch_load", "async_block")}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)

        class Measured(BenchTrainer):
            def post_fit(self) -> None:
                for repeat in range(repeats):
                    self.global_step = 1000 + 2 * repeat  # a fresh directory each time
                    path = self.save_checkpoint(asynchronous=False)
                    results["dcp_save"].append(self._last_save_seconds)
                    state = TrainingState(self).state_dict()
                    target = root / f"torch_{repeat}.pt"
                    results["torch_save"].append(_time(lambda: torch.save(state, target)))
                    results["dcp_load"].append(_time(lambda: self.load_checkpoint(path)))
                    results["torch_load"].append(_time(
                        # Our own file, holding numpy RNG state: not weights-only.
                        lambda: TrainingState(self).load_state_dict(
                            torch.load(target, weights_only=False))))
                    self.global_step += 1
                    results["async_block"].append(
                        _time(lambda: self.save_checkpoint(asynchronous=True)))
                    self._finish_pending_save()
                    shutil.rmtree(path)

            def save_checkpoint(self, asynchronous: bool | None = None) -> Path:
                start = time.perf_counter()
                path = super().save_checkpoint(asynchronous)
                self._last_save_seconds = time.perf_counter() - start
                return path

        config = BenchConfig(
            project="bench", group="checkpoint", experiment="speed", layers=layers,
            device_parameters=DeviceParameters.SINGLE_DEVICE(),
            training_parameters=TrainingParameters(n_epochs=1, train_batch_size=1),
            checkpoint_parameters=CheckpointParameters(root_dir=root, every_n_epochs=None),
        )
        Measured(config).fit()
    median = {k: statistics.median(v) for k, v in results.items()}
    spread = {k: (min(v), max(v)) for k, v in results.items()}
    return {
        "state_bytes": layers * LAYER_BYTES * 3,
        "seconds_median": median,
        "seconds_min_max": spread,
        "ratios": {
            "dcp_save / torch_save": median["dcp_save"] / median["torch_save"],
            "dcp_load / torch_load": median["dcp_load"] / median["torch_load"],
            "async_block / sync_save": median["async_block"] / median["dcp_save"],
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(description="checkpoint speed benchmark")
    parser.add_argument("--size-mb", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    result = measure(args.size_mb, args.repeats)
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    print("\n".join(markdown(result)))


def markdown(result: dict[str, Any]) -> list[str]:
    where = f"checkpoint of {result['state_bytes'] / 2**20:.0f} MiB (weights + AdamW)"
    return [f"| {where}: {name} | {ratio:.2f} |" for name, ratio in result["ratios"].items()]


if __name__ == "__main__":
    main()
