"""Checkpoint bytes on disk and save time of a LoRA run: frozen base left out against the full state.

The Llama of ``lora_memory`` (peft adapters of rank ``r`` on the seven projections, AdamW on
the adapters only) trains under FSDP2 on 2 ranks from a base that this benchmark first writes
with ``save_pretrained`` and gives as ``init_weights_from``: only a base whose source is
recorded can be left out of a checkpoint. Two runs in one ``torchrun`` launch, one per
setting of ``CheckpointParameters.save_frozen_weights``: ``False`` (the default: the
adapters, their AdamW state and the run state, plus the base's source and checksum) and
``True`` (the full state, base included). Each run saves a synchronous checkpoint after every
one of its ``saves`` optimizer steps; a save's time is ``save_checkpoint`` from call to
return on the slower rank (the directory committed), the figure the median over the saves;
the bytes are those of the last checkpoint directory on disk (the page cache as storage).

    python -m benchmarks.lora_checkpoint              # a Llama of 56 M parameters
    python -m benchmarks.lora_checkpoint --quick      # tiny: checks the harness only
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader

from benchmarks.lora_memory import QUICK, MemoryConfig, MemoryTrainer, Shape, batches, build
from benchmarks.processes import REPO_ROOT, child_env
from dream_trainer.checkpoint.storage_base import Location
from dream_trainer.configs import CheckpointParameters, DeviceParameters, TrainingParameters
from dream_trainer.mixins import CheckpointConfigMixin, CheckpointMixin

VARIANTS = {"frozen_left_out": False, "full_state": True}
"""Each run's ``save_frozen_weights``."""


class CheckpointBenchConfig(MemoryConfig, CheckpointConfigMixin):
    lora: bool = True


class CheckpointBenchTrainer(MemoryTrainer, CheckpointMixin):
    """``MemoryTrainer``'s LoRA fine-tune, one step per checkpoint, timing each checkpoint it
    writes."""

    config: CheckpointBenchConfig  # type: ignore[assignment]

    def __init__(self, config: CheckpointBenchConfig) -> None:
        super().__init__(config)
        self.save_seconds: dict[int, float] = {}

    def configure_dataloaders(self) -> tuple[DataLoader[Any], None]:
        saves = self.config.training_parameters.max_steps
        return batches(Shape(**self.config.shape), self.world.world_size, saves), None

    def save_checkpoint(self, asynchronous: bool | None = None) -> Location:
        start = time.perf_counter()
        path = super().save_checkpoint(asynchronous)
        # The save at the end of training finds this step's checkpoint written and returns
        # at once: the first call of a step is the one that wrote it.
        self.save_seconds.setdefault(self.global_step, time.perf_counter() - start)
        return path


def directory_bytes(path: Path) -> int:
    """Bytes of the files under ``path``."""
    return sum(file.stat().st_size for file in path.rglob("*") if file.is_file())


def write_base(shape: Shape, path: Path) -> int:
    """Save the base Llama of ``shape`` (seeded random weights) with ``save_pretrained``;
    return its parameters' bytes."""
    torch.manual_seed(0)
    model = build(shape, lora=False)
    model.save_pretrained(path)
    return sum(p.numel() * p.element_size() for p in model.parameters())


def rank_main(shape: Shape, base: str, root: str, saves: int, out: str) -> None:
    """Run on each rank under torchrun: both runs, then this rank's figures to ``out``."""
    figures: dict[str, Any] = {}
    rank = 0
    for variant, save_frozen in VARIANTS.items():
        config = CheckpointBenchConfig(
            project="bench", group="lora_checkpoint", experiment=variant,
            shape=asdict(shape), init_weights_from=Path(base),
            device_parameters=DeviceParameters.FSDP(),
            training_parameters=TrainingParameters(n_epochs=1, max_steps=saves,
                                                   train_batch_size=shape.batch // 2),
            checkpoint_parameters=CheckpointParameters(
                root_dir=Path(root), every_n_steps=1, every_n_epochs=None,
                save_frozen_weights=save_frozen))
        trainer = CheckpointBenchTrainer(config)
        trainer.fit()
        last = Path(trainer.checkpoint_dir) / f"step_{trainer.global_step}"
        figures[variant] = {"save_seconds": [trainer.save_seconds[step]
                                             for step in sorted(trainer.save_seconds)],
                            "bytes": directory_bytes(last), "checkpoint": last.name}
        rank = trainer.world.rank
    Path(f"{out}.rank{rank}").write_text(json.dumps(figures))


def measure(shape: Shape = Shape(), saves: int = 5) -> dict[str, Any]:
    """Write the base, run both settings on 2 ranks; return bytes, save times and ratios.

    Raises:
        RuntimeError: a rank failed, with the launch's output.
    """
    result: dict[str, Any] = {"shape": asdict(shape), "params": shape.params(),
                              "adapter_params": shape.adapter_params(), "saves": saves}
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp) / "base"
        result["base_bytes"] = write_base(shape, base)
        out = Path(tmp) / "figures"
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                   "--nproc_per_node=2", "-m", "benchmarks.lora_checkpoint", "--rank-main",
                   "--shape", json.dumps(asdict(shape)), "--base", str(base),
                   "--root", str(Path(tmp) / "runs"), "--saves", str(saves), "--out", str(out)]
        done = subprocess.run(command, cwd=REPO_ROOT, env=child_env(), capture_output=True,
                              text=True)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(command)} failed ({done.returncode}):\n"
                               f"{done.stdout}{done.stderr}")
        ranks = [json.loads(Path(f"{out}.rank{rank}").read_text()) for rank in (0, 1)]
    for variant in VARIANTS:
        # A save ends when the slower rank's does (it commits collectively).
        seconds = [max(pair) for pair in zip(*(rank[variant]["save_seconds"]
                                               for rank in ranks))]
        result[variant] = {"bytes": ranks[0][variant]["bytes"],
                           "checkpoint": ranks[0][variant]["checkpoint"],
                           "save_seconds": {"median": statistics.median(seconds),
                                            "min": min(seconds), "max": max(seconds)}}
    left_out, full = result["frozen_left_out"], result["full_state"]
    result["bytes_ratio"] = left_out["bytes"] / full["bytes"]
    result["save_time_ratio"] = (left_out["save_seconds"]["median"]
                                 / full["save_seconds"]["median"])
    return result


def markdown(result: dict[str, Any]) -> list[str]:
    """Table rows ``| what | figure |`` for the benchmark report."""
    where = (f"checkpoint of a LoRA run (Llama of {result['params']:,} parameters, r="
             f"{result['shape']['r']}), FSDP2 on 2 ranks")
    rows = []
    for variant, label in (("full_state", "full state"),
                           ("frozen_left_out", "frozen base left out")):
        run = result[variant]
        rows.append(f"| {where}: {label} | {run['bytes'] / 2**20:.2f} MiB, saved in "
                    f"{run['save_seconds']['median']:.3f} s |")
    rows.append(f"| {where}: frozen base left out / full state | bytes "
                f"{result['bytes_ratio']:.4f}, save time {result['save_time_ratio']:.2f} |")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description="LoRA checkpoint size and save time")
    parser.add_argument("--quick", action="store_true", help="a tiny model: checks the harness")
    parser.add_argument("--saves", type=int, default=5)
    parser.add_argument("--rank-main", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--shape", help=argparse.SUPPRESS)
    parser.add_argument("--base", help=argparse.SUPPRESS)
    parser.add_argument("--root", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank_main:
        rank_main(Shape(**json.loads(args.shape)), args.base, args.root, args.saves, args.out)
        return
    result = measure(QUICK if args.quick else Shape(), args.saves)
    print(json.dumps(result, indent=2))
    print("\n".join(["", "| what | figure |", "|---|---|", *markdown(result)]))


if __name__ == "__main__":
    main()
