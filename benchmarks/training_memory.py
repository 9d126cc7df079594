"""Peak memory of ``BaseTrainer`` against a hand-written loop while training (goal: +1 % at most).

Both variants train the same MLP of ``--size-mb`` MiB of fp32 weights (``Linear(1024, 1024)``
layers with ReLUs) with AdamW for a few steps, each in its own subprocess: (a) a
hand-written loop, (b) ``BaseTrainer`` + ``SetupMixin`` (the model is built on the meta
device and materialized once). Training state, four times the weights (weights, gradients,
two AdamW moments), dominates both peaks.

Each child records its RSS once its imports are done and one AdamW step of a tiny model
has loaded what torch imports lazily (the baseline; see ``warm_up_torch``), and
``ru_maxrss`` when training has ended. The baseline therefore excludes the import of
dream_trainer and what it pulls in beyond a training-ready torch (pydantic, and torch's
distributed checkpoint and elastic modules; rich is imported only by callbacks that
``BaseTrainer`` does not attach): that cost does not grow with the model, and it is reported
separately as the difference of the two baselines. The figures are the absolute peaks, the
peaks above baseline, and the ratios (b)/(a) of each, as medians (and spread) over repeats.
Linux and glibc only: RSS is read from ``/proc/self/status``, ``ru_maxrss`` is in KiB, and
the children run with a fixed ``MALLOC_MMAP_THRESHOLD_`` (see ``run_child``).

    python -m benchmarks.training_memory [--size-mb 128] [--steps 3] [--repeats 3]
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
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from benchmarks.processes import REPO_ROOT, child_env, current_rss_bytes, peak_rss_bytes
from benchmarks.workloads import BATCH, LR, SEED

WIDTH = 1024
LAYER_BYTES = (WIDTH * WIDTH + WIDTH) * 4
GOAL = 1.01




def build_model(layers: int) -> nn.Module:
    """``layers`` square linear layers with ReLUs between them."""
    blocks: list[nn.Module] = [nn.Linear(WIDTH, WIDTH)]
    for _ in range(layers - 1):
        blocks += [nn.ReLU(), nn.Linear(WIDTH, WIDTH)]
    return nn.Sequential(*blocks)


def loader(steps: int) -> DataLoader[Any]:
    """``steps`` batches of random inputs with random class labels among ``WIDTH``."""
    generator = torch.Generator().manual_seed(1)
    samples = steps * BATCH
    return DataLoader(TensorDataset(torch.randn(samples, WIDTH, generator=generator),
                                    torch.randint(0, WIDTH, (samples,), generator=generator)),
                      batch_size=BATCH)


def hand_written(layers: int, steps: int) -> None:
    """(a): plain PyTorch, with the gradient norm ``BaseTrainer.step()`` computes."""
    torch.manual_seed(SEED)
    model = build_model(layers)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    model.train()
    for x, y in loader(steps):
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        torch.nn.utils.get_total_norm([p.grad for p in model.parameters()], foreach=True)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


def warm_up_torch() -> None:
    """One AdamW step of a tiny model. Torch's first optimizer step imports ``torch._dynamo``
    and sympy (~80 MiB), much of which dream_trainer's import loads up front: it must precede
    both baselines, or the hand loop's peak above baseline would count it and (b)'s not."""
    model = nn.Linear(8, 8)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    F.cross_entropy(model(torch.zeros(2, 8)), torch.zeros(2, dtype=torch.long)).backward()
    torch.nn.utils.get_total_norm([p.grad for p in model.parameters()], foreach=True)
    optimizer.step()


def child(variant: str, layers: int, steps: int, out: Path) -> None:
    """In the subprocess: import, take the baseline, train, write the figures to ``out``."""
    if variant == "base":
        from dream_trainer import BaseTrainer, BaseTrainerConfig
        from dream_trainer.configs import DeviceParameters, TrainingParameters
        from dream_trainer.mixins import SetupConfigMixin, SetupMixin
    warm_up_torch()
    baseline = current_rss_bytes()
    if variant == "hand":
        hand_written(layers, steps)
    else:
        class MemoryConfig(BaseTrainerConfig, SetupConfigMixin):
            layers: int
            steps: int

        class MemoryTrainer(BaseTrainer, SetupMixin):
            config: MemoryConfig

            def configure_models(self) -> None:
                self.model = build_model(self.config.layers)

            def configure_optimizers(self) -> None:
                self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=LR)

            def configure_dataloaders(self) -> tuple[DataLoader[Any], None]:
                return loader(self.config.steps), None

            def training_step(self, batch: Any, batch_idx: int) -> dict[str, Any]:
                x, y = batch
                loss = F.cross_entropy(self.model(x), y)
                self.backward(loss)
                return {"loss": loss, "grad_norm": self.step(self.model, self.optimizer)}

            def validation_step(self, batch: Any, batch_idx: int) -> dict[str, Any]:
                return {}

        MemoryTrainer(MemoryConfig(
            project="bench", group="memory", experiment="training", seed=SEED, layers=layers,
            steps=steps, device_parameters=DeviceParameters.SINGLE_DEVICE(),
            training_parameters=TrainingParameters(n_epochs=1, train_batch_size=BATCH))).fit()
    out.write_text(json.dumps({"baseline_bytes": baseline, "peak_bytes": peak_rss_bytes()}))


def run_child(variant: str, layers: int, steps: int, out: Path) -> dict[str, int]:
    """Run ``child`` in a fresh interpreter; return its figures.

    Raises:
        RuntimeError: the child failed, with its output.
    """
    env = child_env()
    # glibc raises its mmap threshold whenever an mmapped block is freed; blocks of that size
    # then come from the heap and, once freed, stay in RSS by chance, so identical runs peaked
    # up to 25 MiB apart. A fixed threshold returns every freed tensor of 128 KiB or more to
    # the OS, and the peak counts live tensors only.
    env["MALLOC_MMAP_THRESHOLD_"] = str(128 * 1024)
    command = [sys.executable, "-m", "benchmarks.training_memory", "--child", variant,
               "--layers", str(layers), "--steps", str(steps), "--out", str(out)]
    done = subprocess.run(command, cwd=REPO_ROOT, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed ({done.returncode}):\n"
                           f"{done.stdout}{done.stderr}")
    figures: dict[str, int] = json.loads(out.read_text())
    figures["peak_above_baseline_bytes"] = figures["peak_bytes"] - figures["baseline_bytes"]
    return figures


def spread(values: list[float]) -> dict[str, float]:
    """Median, min and max of ``values``."""
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def measure(size_mb: int = 128, steps: int = 3, repeats: int = 3) -> dict[str, Any]:
    """Train both variants ``repeats`` times in turn; return peaks, baselines and ratios."""
    layers = max(1, round(size_mb * 2**20 / LAYER_BYTES))
    runs: dict[str, list[dict[str, int]]] = {"hand": [], "base": []}
    with tempfile.TemporaryDirectory() as tmp:
        for index in range(repeats):
            for variant in runs:
                runs[variant].append(run_child(variant, layers, steps,
                                               Path(tmp) / f"{variant}{index}.json"))

    def paired(key: str) -> list[tuple[int, int]]:
        return [(hand[key], base[key]) for hand, base in zip(runs["hand"], runs["base"])]

    result: dict[str, Any] = {"model_bytes": layers * LAYER_BYTES, "layers": layers,
                              "steps": steps, "repeats": repeats, "goal": GOAL}
    for variant, variant_runs in runs.items():
        result[variant] = {key: spread([run[key] for run in variant_runs])
                           for key in variant_runs[0]}
    result["import_difference_bytes"] = spread([b - a for a, b in paired("baseline_bytes")])
    result["ratio_peak"] = spread([b / a for a, b in paired("peak_bytes")])
    result["ratio_peak_above_baseline"] = spread(
        [b / a for a, b in paired("peak_above_baseline_bytes")])
    result["meets_goal"] = result["ratio_peak_above_baseline"]["median"] <= GOAL
    return result


def markdown(result: dict[str, Any]) -> list[str]:
    """Table rows ``| what | figure |`` for the benchmark report."""
    def mib(values: dict[str, float]) -> str:
        return (f"{values['median'] / 2**20:.1f} MiB "
                f"({values['min'] / 2**20:.1f}-{values['max'] / 2**20:.1f})")

    def ratio(values: dict[str, float]) -> str:
        return f"{values['median']:.3f} ({values['min']:.3f}-{values['max']:.3f})"

    model = f"{result['model_bytes'] / 2**20:.0f} MiB MLP, AdamW, {result['steps']} steps"
    return [
        f"| peak RSS, hand-written loop ({model}) | {mib(result['hand']['peak_bytes'])} |",
        f"| peak RSS, BaseTrainer ({model}) | {mib(result['base']['peak_bytes'])} |",
        f"| peak RSS above baseline, hand-written loop | "
        f"{mib(result['hand']['peak_above_baseline_bytes'])} |",
        f"| peak RSS above baseline, BaseTrainer | "
        f"{mib(result['base']['peak_above_baseline_bytes'])} |",
        f"| BaseTrainer / hand-written loop, peak RSS | {ratio(result['ratio_peak'])} |",
        f"| BaseTrainer / hand-written loop, peak above baseline (goal <= {result['goal']:.2f}) "
        f"| {ratio(result['ratio_peak_above_baseline'])} |",
        f"| RSS of importing dream_trainer beyond torch (baseline (b) - (a)) | "
        f"{mib(result['import_difference_bytes'])} |",
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description="training peak memory benchmark")
    parser.add_argument("--size-mb", type=int, default=128)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--child", choices=["hand", "base"], help=argparse.SUPPRESS)
    parser.add_argument("--layers", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child is not None:
        child(args.child, args.layers, args.steps, args.out)
        return
    result = measure(args.size_mb, args.steps, args.repeats)
    print(json.dumps(result, indent=2))
    print("\n".join(["", "| what | figure |", "|---|---|", *markdown(result)]))


if __name__ == "__main__":
    main()
