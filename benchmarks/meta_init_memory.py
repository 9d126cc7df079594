"""Per-rank peak memory while setting up a large model with FSDP2 on 2 ranks.

Compares dream_trainer's meta-device path (build on meta, shard, materialize only the local
shards) with naive full materialization (build the whole model on every rank, then shard),
through the same trainer. Figures are the per-rank peak RSS above the torch baseline, as a
fraction of the full fp32 model size. The baseline is the RSS once the process group has
started and torch's FSDP2, DTensor and dynamo modules are loaded (``fully_shard`` imports
``torch._dynamo``, ~27 MiB, whatever the model size).

    python -m benchmarks.meta_init_memory            # ~1 GB model
    python -m benchmarks.meta_init_memory --size-mb 256
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
import torch._dynamo  # noqa: F401  (part of the torch baseline, see the module docstring)
import torch.distributed.fsdp  # noqa: F401
import torch.distributed.tensor  # noqa: F401
from torch import nn

from benchmarks.setup_only import SetupOnlyTrainer

from dream_trainer import BaseTrainerConfig
from dream_trainer.configs import DeviceParameters, TrainingParameters
from dream_trainer.mixins import SetupConfigMixin

WIDTH = 2048
LAYER_BYTES = (WIDTH * WIDTH + WIDTH) * 4




class MemoryConfig(BaseTrainerConfig, SetupConfigMixin):
    layers: int
    naive: bool = False


class BigModelTrainer(SetupOnlyTrainer):
    config: MemoryConfig

    def configure_models(self) -> None:
        def build() -> nn.Module:
            return nn.Sequential(*(nn.Linear(WIDTH, WIDTH) for _ in range(self.config.layers)))

        if self.config.naive:
            with torch.device("cpu"):  # escape the meta device: every rank builds it all
                self.model = build()
        else:
            self.model = build()


def rank_main(layers: int, naive: bool, out: str) -> None:
    """Run on each rank under torchrun: set up the model and record this rank's figure."""
    config = MemoryConfig(project="bench", group="memory", experiment="meta", layers=layers,
                          naive=naive, device_parameters=DeviceParameters.FSDP(),
                          training_parameters=TrainingParameters(n_epochs=1, train_batch_size=1,
                                                                 max_steps=1))
    trainer = BigModelTrainer(config)
    trainer.fit()
    Path(f"{out}.rank{trainer.world.rank}").write_text(str(trainer.peak_above_baseline))


def measure(size_mb: int) -> dict[str, Any]:
    """Launch both variants on 2 ranks; return the per-rank figures and ratios."""
    layers = max(1, round(size_mb * 2**20 / LAYER_BYTES))
    model_bytes = layers * LAYER_BYTES
    result: dict[str, Any] = {"model_bytes": model_bytes, "layers": layers}
    with tempfile.TemporaryDirectory() as tmp:
        for variant in ("meta", "naive"):
            out = str(Path(tmp) / variant)
            command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                       "--nproc_per_node=2", "-m", "benchmarks.meta_init_memory", "--rank-main",
                       "--layers", str(layers), "--out", out] + (["--naive"] if variant == "naive" else [])
            subprocess.run(command, check=True, capture_output=True, text=True)
            peaks = [int(Path(f"{out}.rank{rank}").read_text()) for rank in (0, 1)]
            result[variant] = {"peak_above_baseline_bytes": peaks,
                               "ratio_to_model": max(peaks) / model_bytes}
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description="meta-device setup memory benchmark")
    parser.add_argument("--size-mb", type=int, default=1024)
    parser.add_argument("--rank-main", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--layers", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--naive", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank_main:
        rank_main(args.layers, args.naive, args.out)
        return
    result = measure(args.size_mb)
    print(json.dumps(result, indent=2))
    print("\n".join(markdown(result)))


def markdown(result: dict[str, Any]) -> list[str]:
    where = f"setup of a {result['model_bytes'] / 2**20:.0f} MiB model, FSDP2 on 2 ranks"
    return [f"| {where}: peak RSS per rank / model size, meta device (dream_trainer) | "
            f"{result['meta']['ratio_to_model']:.2f} |",
            f"| {where}: peak RSS per rank / model size, naive full materialization | "
            f"{result['naive']['ratio_to_model']:.2f} |"]


if __name__ == "__main__":
    main()
