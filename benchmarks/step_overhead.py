"""Per-step overhead of the trainers against a hand-written PyTorch loop.

The same model, data, seed, initialization and optimizer (``benchmarks.workloads``) are
trained by (a) a hand-written loop, (b) ``BaseTrainer`` + ``SetupMixin``, (c) ``DreamTrainer``
with its default callbacks (progress lines, LR monitor, JSON logs, a checkpoint at the end)
and, given a Lightning interpreter, (d) Lightning's ``Trainer`` in its own virtual environment
(``benchmarks.lightning_steps``). Each step's wall time is taken after a warm-up; a trial
reports the median step time of each variant, and the figures are the medians (and spread)
of the per-trial ratios to (a), so machine noise affects all variants alike. (b) must end
with weights identical to (a).

With ``--ranks 2`` the variants run under torchrun on 2 CPU ranks: (a) wraps the model in
DDP itself and reads every second sample, as the trainers' samplers do.

    python -m benchmarks.step_overhead [--model mlp|mlp512|transformer] [--steps 300] [--trials 5]
                                       [--ranks 1|2] [--lightning-python PATH]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader

from benchmarks import lightning_steps
from benchmarks.processes import REPO_ROOT, child_env
from benchmarks.step_timer import StepTimer
from benchmarks.workloads import (LR, MODELS, SEED, batch_size, build_model, dataset,
                                  hand_written, init_weights)
from dream_trainer import BaseTrainer, BaseTrainerConfig, DreamTrainer, DreamTrainerConfig
from dream_trainer.configs import CheckpointParameters, LoggingParameters, TrainingParameters
from dream_trainer.mixins import SetupConfigMixin, SetupMixin

WARMUP = 20


class BenchConfig(BaseTrainerConfig, SetupConfigMixin):
    kind: str
    steps: int


class Timed(StepTimer):
    """Shared by (b) and (c): time each step from pre_train_batch to post_train_batch."""

    def configure_models(self) -> None:
        self.model = build_model(self.config.kind)  # type: ignore[attr-defined]

    def init_weights(self) -> None:
        init_weights(self.model)

    def configure_optimizers(self) -> None:
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=LR)

    def configure_dataloaders(self) -> tuple[DataLoader[Any], None]:
        config = self.config  # type: ignore[attr-defined]
        batch = batch_size(config.kind)
        data = dataset(config.kind, config.steps * batch * self.world.dp_size)  # type: ignore[attr-defined]
        return DataLoader(data, batch_size=batch), None

    def training_step(self, batch: Any, batch_idx: int) -> dict[str, Any]:
        x, y = batch
        loss = F.cross_entropy(self.model(x), y)
        self.backward(loss)  # type: ignore[attr-defined]
        return {"loss": loss, "grad_norm": self.step(self.model, self.optimizer)}  # type: ignore[attr-defined]

    def validation_step(self, batch: Any, batch_idx: int) -> dict[str, Any]:
        return {}



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
    model = trainer.model
    return trainer.times, getattr(model, "module", model)


def trial_medians(kind: str, steps: int, workdir: Path) -> tuple[dict[str, float], bool]:
    """One trial of (a), (b), (c) in this process (every rank runs it under torchrun)."""
    common = {"project": "bench", "group": "overhead", "experiment": kind, "seed": SEED,
              "kind": kind, "steps": steps,
              "training_parameters": TrainingParameters(n_epochs=1,
                                                        train_batch_size=batch_size(kind))}
    hand_times, hand_model = hand_written(kind, steps)
    base_times, base_model = run_trainer(BaseBench, BenchConfig(**common))
    dream_times, _ = run_trainer(DreamBench, DreamConfig(
        **common, checkpoint_parameters=CheckpointParameters(root_dir=workdir),
        logging_parameters=LoggingParameters(log_dir=workdir)))
    identical = all(torch.equal(a, b) for a, b in zip(hand_model.state_dict().values(),
                                                      base_model.state_dict().values()))
    medians = {name: statistics.median(times[WARMUP:]) for name, times in
               (("hand", hand_times), ("base", base_times), ("dream", dream_times))}
    return medians, identical


def summarize(trials: list[dict[str, float]], identical: bool, **facts: Any) -> dict[str, Any]:
    """Medians of each variant's step time and of its per-trial ratio to the hand loop."""
    names = list(trials[0])
    ratios = {name: [t[name] / t["hand"] for t in trials] for name in names if name != "hand"}
    return {
        **facts, "trials": len(trials),
        "median_step_seconds": {n: statistics.median(t[n] for t in trials) for n in names},
        "ratio_to_hand": {n: statistics.median(r) for n, r in ratios.items()},
        "ratio_spread": {n: [min(r), max(r)] for n, r in ratios.items()},
        "base_weights_identical_to_hand": identical,
    }


def measure(kind: str = "mlp", steps: int = 300, trials: int = 5, ranks: int = 1,
            lightning_python: str | None = None) -> dict[str, Any]:
    """Run the trials (under torchrun when ``ranks > 1``) and summarize them."""
    if ranks > 1:
        trial_list, identical = _torchrun_trials(kind, steps, trials, ranks)
    else:
        trial_list, identical = [], True
        with tempfile.TemporaryDirectory() as tmp:
            for index in range(trials):
                medians, same = trial_medians(kind, steps, Path(tmp) / str(index))
                if lightning_python:  # right after the trial it is compared with
                    medians["lightning"] = _lightning_median(lightning_python, kind, steps, 1)
                trial_list.append(medians)
                identical &= same
    if lightning_python and ranks > 1:
        # The torchrun trials are over: each Lightning run is compared with their median.
        hand = statistics.median(t["hand"] for t in trial_list)
        for trial in trial_list:
            lightning = _lightning_median(lightning_python, kind, steps, ranks)
            trial["lightning"] = lightning * trial["hand"] / hand
    return summarize(trial_list, identical, model=kind, steps=steps, ranks=ranks)


def _lightning_median(python: str, kind: str, steps: int, ranks: int) -> float:
    return statistics.median(lightning_steps.run(python, kind, steps, ranks)[WARMUP:])


def _torchrun_trials(kind: str, steps: int, trials: int,
                     ranks: int) -> tuple[list[dict[str, float]], bool]:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "trials.json"
        env = {**child_env(), "OMP_NUM_THREADS": "1"}
        subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--standalone",
             f"--nproc_per_node={ranks}", "-m", "benchmarks.step_overhead", "--worker",
             "--model", kind, "--steps", str(steps), "--trials", str(trials), "--out", str(out)],
            env=env, cwd=REPO_ROOT, check=True, stdout=subprocess.DEVNULL, timeout=1800)
        result = json.loads(out.read_text())
    return result["trials"], result["identical"]


def worker(kind: str, steps: int, trials: int, out: Path) -> None:
    """One rank of ``--ranks N``: the trials on a process group shared by all variants."""
    dist.init_process_group("gloo")
    try:
        trial_list, identical = [], True
        with tempfile.TemporaryDirectory() as tmp:
            workdir = [tmp]
            dist.broadcast_object_list(workdir, src=0)  # rank 0's directory for all ranks
            for index in range(trials):
                medians, same = trial_medians(kind, steps, Path(workdir[0]) / str(index))
                trial_list.append(medians)
                identical &= same
            dist.barrier()  # rank 0's directory outlives every rank's last checkpoint
        if dist.get_rank() == 0:
            out.write_text(json.dumps({"trials": trial_list, "identical": identical}))
    finally:
        dist.barrier()  # gloo may abort a process that leaves before its peer
        dist.destroy_process_group()


def markdown(result: dict[str, Any]) -> list[str]:
    where = "1 process" if result["ranks"] == 1 else f"DDP, {result['ranks']} ranks"
    hand_ms = result["median_step_seconds"]["hand"] * 1e3
    rows = [f"| {result['model']}, {where}: hand-written loop | {hand_ms:.2f} ms/step |"]
    labels = {"base": "BaseTrainer", "dream": "DreamTrainer", "lightning": "Lightning Trainer"}
    for name, ratio in result["ratio_to_hand"].items():
        low, high = result["ratio_spread"][name]
        rows.append(f"| {result['model']}, {where}: {labels[name]} / hand-written | "
                    f"{ratio:.3f} ({low:.3f}-{high:.3f}) |")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description="trainer step overhead benchmark")
    parser.add_argument("--model", choices=MODELS, default="mlp")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--trials", type=int, default=5)
    parser.add_argument("--ranks", type=int, default=1)
    parser.add_argument("--lightning-python", help="interpreter of a venv with lightning")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.model, args.steps, args.trials, args.out)
        return
    result = measure(args.model, args.steps, args.trials, args.ranks, args.lightning_python)
    print(json.dumps(result, indent=2))
    print("\n".join(markdown(result)))


if __name__ == "__main__":
    main()
