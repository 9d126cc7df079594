"""Time from launch to the first optimizer step after a resume, on 2 ranks.

A stack of ``Linear(2048, 2048)`` layers (1 GiB of float32 weights by default) is trained
with AdamW, each run a fresh ``torchrun --nproc_per_node=2`` on this machine:

1. FSDP2, starting fresh: one step, then it saves its checkpoint (weights and both AdamW
   moments, 3 GiB at the default size);
2. FSDP2, resumed from that checkpoint (the same layout);
3. the changed layout (tensor parallel by default: even layers column-wise, odd layers
   row-wise, so half the weights are sliced across the saved shards), starting fresh;
4. the changed layout, resumed from the FSDP2 checkpoint.

Each figure is the time from just before the parent starts ``torchrun`` to the end of the
first optimizer step of that run (on the last rank to finish it): interpreter start,
imports, process group, model build and initialization, the resume (checksums of the files,
each rank a share, then DCP's load, each rank its slices) and one step. A fresh start of the
same layout in the same trial is the baseline: ``resumed / fresh`` and ``resumed - fresh``.
The checkpoint is read from the page cache (it has just been written).

    python -m benchmarks.resume_time                      # 1 GiB of weights, 1 trial
    python -m benchmarks.resume_time --size-gib 0.25 --changed ddp --trials 3
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from benchmarks.checkpoint_speed import BenchConfig, BenchTrainer
from benchmarks.processes import child_env, peak_rss_bytes

from dream_trainer.configs import CheckpointParameters, DeviceParameters, TrainingParameters

WIDTH = 2048
LAYER_BYTES = (WIDTH * WIDTH + WIDTH) * 4
SAMPLES = 8
"""Samples of one epoch: at least 2 batches per rank in every layout, so the resumed step is
the second of the epoch."""

LAYOUTS = {"fsdp": DeviceParameters.FSDP, "ddp": DeviceParameters.DDP,
           "tp": lambda: DeviceParameters(tensor_parallel=2)}
"""The 2-rank layouts a run can take; the checkpoint is always written by ``fsdp``."""


class ResumeConfig(BenchConfig):
    timings: Path
    """Each rank writes ``<timings>.rank<R>``: its clock at setup and at its first step."""


class ResumeTrainer(BenchTrainer):
    """AdamW on the layer stack; records the wall clock at the phases the figure spans."""

    config: ResumeConfig

    def configure_models(self) -> None:
        self.model = nn.Sequential(*(nn.Linear(WIDTH, WIDTH) for _ in range(self.config.layers)))

    def apply_tensor_parallel(self, tp_mesh: Any) -> None:
        from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                       parallelize_module)

        plan = {str(index): ColwiseParallel() if index % 2 == 0 else RowwiseParallel()
                for index in range(self.config.layers)}
        parallelize_module(self.model, tp_mesh, plan)

    def configure_dataloaders(self) -> tuple[DataLoader[Any], None]:
        generator = torch.Generator().manual_seed(0)
        return DataLoader(TensorDataset(torch.randn(SAMPLES, WIDTH, generator=generator)),
                          batch_size=1), None

    def pre_setup(self) -> None:
        self.clock = {"pre_setup": time.time()}

    def post_setup(self) -> None:
        # After the checkpoint mixin's own post_setup work, which is the resume.
        self.clock["post_setup"] = time.time()
        self.resumed_at = self.global_step
        self.setup_peak_rss = peak_rss_bytes()

    def post_train_batch(self, result: dict[str, Any], batch_idx: int) -> None:
        if "first_step" in self.clock:
            return
        self.clock["first_step"] = time.time()
        figures = {"clock": self.clock, "resumed_at": self.resumed_at,
                   "peak_rss_bytes": {"setup": self.setup_peak_rss,
                                      "first_step": peak_rss_bytes()}}
        Path(f"{self.config.timings}.rank{self.world.rank}").write_text(json.dumps(figures))


def worker(layout: str, layers: int, root: Path, experiment: str, resume: Path | None,
           timings: Path) -> None:
    """One rank of one run: train until the first step after ``resume`` (or the first)."""
    steps = 1 if resume is None else 2
    config = ResumeConfig(
        project="bench", group="resume", experiment=experiment, layers=layers,
        timings=timings, device_parameters=LAYOUTS[layout](),
        training_parameters=TrainingParameters(n_epochs=1, train_batch_size=1,
                                               max_steps=steps),
        checkpoint_parameters=CheckpointParameters(root_dir=root, resume=resume,
                                                   every_n_epochs=None))
    ResumeTrainer(config).fit()


def launch(layout: str, layers: int, root: Path, experiment: str,
           resume: Path | None) -> dict[str, Any]:
    """Run one 2-rank run; its seconds from launch to each phase (the slower rank's), and
    the largest per-rank peak RSS by the end of setup and of the first step."""
    timings = root / f"{experiment}.timings"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc_per_node=2", "-m", "benchmarks.resume_time", "--worker", layout,
               "--layers", str(layers), "--root", str(root), "--experiment", experiment,
               "--timings", str(timings)] + ([] if resume is None else ["--resume", str(resume)])
    launched = time.time()
    result = subprocess.run(command, env=child_env(), capture_output=True, text=True,
                            timeout=1800)
    if result.returncode != 0:
        raise RuntimeError(f"the {experiment} run failed:\n{result.stderr[-3000:]}")
    ranks = [json.loads(Path(f"{timings}.rank{rank}").read_text()) for rank in (0, 1)]
    expected = 0 if resume is None else 1
    if any(rank["resumed_at"] != expected for rank in ranks):
        raise RuntimeError(f"the {experiment} run started at step "
                           f"{[rank['resumed_at'] for rank in ranks]}, not {expected}")
    return {phase: max(rank["clock"][phase] for rank in ranks) - launched
            for phase in ("pre_setup", "post_setup", "first_step")} | {
        "peak_rss_bytes": {when: max(rank["peak_rss_bytes"][when] for rank in ranks)
                           for when in ("setup", "first_step")}}


def trial(layers: int, changed: str, root: Path) -> dict[str, Any]:
    """The four runs of the module docstring in ``root``; the checkpoint's size on disk."""
    runs = {"fsdp fresh": launch("fsdp", layers, root, "fsdp", None)}
    checkpoint = root / "bench/resume/fsdp/checkpoints/step_1"
    runs["fsdp resumed"] = launch("fsdp", layers, root, "fsdp_resumed", checkpoint)
    runs[f"{changed} fresh"] = launch(changed, layers, root, changed, None)
    runs[f"{changed} resumed"] = launch(changed, layers, root, f"{changed}_resumed", checkpoint)
    size = sum(file.stat().st_size for file in checkpoint.rglob("*") if file.is_file())
    return {"runs": runs, "checkpoint_bytes": size}


def spread(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def measure(size_gib: float = 1.0, changed: str = "tp", trials: int = 1) -> dict[str, Any]:
    """``trials`` times the four runs; seconds to the first step and the resume's cost.

    Raises:
        ValueError: if ``changed`` is not a layout other than ``fsdp``.
    """
    others = sorted(set(LAYOUTS) - {"fsdp"})
    if changed not in others:
        raise ValueError(f"changed={changed!r}: the checkpoint is written by fsdp, resume it "
                         f"on one of {others}")
    layers = max(2, 2 * round(size_gib * 2**30 / LAYER_BYTES / 2))  # even, for the TP plan
    results = []
    for _ in range(trials):
        with tempfile.TemporaryDirectory() as tmp:
            results.append(trial(layers, changed, Path(tmp)))
    names = list(results[0]["runs"])
    seconds = {name: spread([r["runs"][name]["first_step"] for r in results])
               for name in names}
    setup = {name: spread([r["runs"][name]["post_setup"] - r["runs"][name]["pre_setup"]
                           for r in results]) for name in names}
    resume: dict[str, Any] = {}
    for layout in ("fsdp", changed):
        fresh = [r["runs"][f"{layout} fresh"] for r in results]
        resumed = [r["runs"][f"{layout} resumed"] for r in results]
        resume[layout] = {
            "ratio": spread([b["first_step"] / a["first_step"]
                             for a, b in zip(fresh, resumed)]),
            "difference_seconds": spread([b["first_step"] - a["first_step"]
                                          for a, b in zip(fresh, resumed)]),
            # The resume runs inside setup: this difference leaves out the noise of start-up
            # and of the step's collectives.
            "setup_difference_seconds": spread([
                (b["post_setup"] - b["pre_setup"]) - (a["post_setup"] - a["pre_setup"])
                for a, b in zip(fresh, resumed)])}
    return {"model_bytes": layers * LAYER_BYTES, "layers": layers, "trials": trials,
            "changed_layout": changed, "checkpoint_bytes": results[0]["checkpoint_bytes"],
            "seconds_to_first_step": seconds, "setup_seconds": setup,
            "peak_rss_bytes": {name: {when: max(r["runs"][name]["peak_rss_bytes"][when]
                                                for r in results)
                                          for when in ("setup", "first_step")}
                               for name in names},
            "resumed_over_fresh": resume}


def markdown(result: dict[str, Any]) -> list[str]:
    where = (f"resume of a {result['model_bytes'] / 2**30:.2f} GiB model "
             f"({result['checkpoint_bytes'] / 2**30:.2f} GiB checkpoint) on 2 ranks")
    rows = [f"| {where}: launch to first step, {name} | {values['median']:.1f} s |"
            for name, values in result["seconds_to_first_step"].items()]
    for layout, figures in result["resumed_over_fresh"].items():
        source = "" if layout == "fsdp" else " (saved by fsdp)"
        rows.append(f"| {where}: {layout} resumed{source} / fresh | "
                    f"{figures['ratio']['median']:.2f} "
                    f"({figures['difference_seconds']['median']:+.1f} s to the first step, "
                    f"{figures['setup_difference_seconds']['median']:+.1f} s in setup) |")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-gib", type=float, default=1.0, help="float32 weights")
    parser.add_argument("--changed", choices=sorted(set(LAYOUTS) - {"fsdp"}), default="tp",
                        help="the layout the FSDP2 checkpoint is also resumed on")
    parser.add_argument("--trials", type=int, default=1)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--worker", choices=sorted(LAYOUTS), help=argparse.SUPPRESS)
    parser.add_argument("--layers", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--root", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--experiment", help=argparse.SUPPRESS)
    parser.add_argument("--resume", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--timings", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker is not None:
        worker(args.worker, args.layers, args.root, args.experiment, args.resume, args.timings)
        return
    if not (math.isfinite(args.size_gib) and args.size_gib > 0):
        parser.error(f"--size-gib must be a positive number of GiB, got {args.size_gib}")
    result = measure(args.size_gib, args.changed, args.trials)
    print(json.dumps(result, indent=2))
    print("\n".join(markdown(result)))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
