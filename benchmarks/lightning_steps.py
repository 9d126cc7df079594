"""Lightning's per-step time on the workload of ``step_overhead``'s hand-written loop.

Lightning lives in its own virtual environment, so this module has two halves. The runner
(``python -m benchmarks.lightning_steps --model mlp --steps 300 --devices 1 --out x.json``,
started by that environment's interpreter with the repository root on ``PYTHONPATH``) trains
with ``lightning.Trainer`` and writes ``{"step_times": [...], "final_weights_sha": ...}``; it
imports only torch, Lightning and ``benchmarks.workloads``. ``run()`` and ``measure()`` are
called from dream_trainer's environment: they start the runner as a subprocess and, for
``measure()``, time the hand-written loop in the calling process in the same trials, so the
published figure is a ratio measured in one run.

What Lightning trains is the hand loop's: the same model and initialization
(``init_weights``), AdamW, an unshuffled DataLoader of ``steps * batch_size(kind) *
devices`` samples, cross entropy, and the same ``get_total_norm`` of the gradients (in
``on_before_optimizer_step``, where Lightning exposes them before the optimizer steps). A
step is timed from ``on_train_batch_start`` to ``on_train_batch_end``: forward, backward,
norm, optimizer step, zeroing, and Lightning's own bookkeeping between those hooks. On one
process the final weights equal the hand loop's bit for bit: Lightning's 32-bit precision
calls ``loss.backward()`` and ``optimizer.step()`` unchanged, and zeroing the gradients
before backward instead of after the step changes nothing. With ``devices=2``
(``strategy="ddp"``, gloo on CPU; Lightning starts rank 1 itself) each rank trains on half
the samples and DDP averages the gradients, so the weights legitimately differ from a
one-process loop and only rank 0 reports.

    /tmp/lightning-venv/bin/python -m benchmarks.lightning_steps --devices 2 --out x.json
    python -m benchmarks.lightning_steps --python /tmp/lightning-venv/bin/python [--trials 5]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import statistics
import subprocess

import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader

from benchmarks.processes import REPO_ROOT, child_env
from benchmarks.workloads import (LR, MODELS, SEED, batch_size, build_model, dataset,
                                  hand_written, init_weights)

WARMUP = 20


def weights_sha(model: nn.Module) -> str:
    """SHA-256 of the state dict's tensors in order, so weights compare across processes."""
    digest = hashlib.sha256()
    for tensor in model.state_dict().values():
        digest.update(tensor.detach().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()


def train(kind: str, steps: int, devices: int = 1,
          first_step_marker: str | None = None) -> dict[str, Any] | None:
    """Train with ``lightning.Trainer`` in this process; needs Lightning installed.

    Args:
        kind: A model of ``benchmarks.workloads``.
        steps: Optimizer steps (each rank sees ``steps`` batches).
        devices: CPU processes; 2 uses DDP, and Lightning starts the second process.
        first_step_marker: Printed (flushed) once the first step has ended, for ``startup``.

    Returns:
        On rank 0 the step times, the final weights' SHA-256 and the last gradient norm;
        None on other ranks.
    """
    import lightning as L  # only the runner's environment has it
    from lightning.pytorch.callbacks import Callback

    # A benchmark's output is its JSON: Lightning's banner, its advice about DataLoader
    # workers (which the hand loop does not use either) and its use of a pytree API that
    # torch 2.13 deprecates would only bury it.
    for name in ("lightning.pytorch", "lightning.fabric"):
        logging.getLogger(name).setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", ".*does not have many workers.*")
    warnings.filterwarnings("ignore", ".*isinstance.treespec, LeafSpec.*")

    class Classifier(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = build_model(kind)
            init_weights(self.model)
            self.grad_norm = torch.zeros(())

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            return F.cross_entropy(self.model(x), y)

        def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
            self.grad_norm = torch.nn.utils.get_total_norm(
                [p.grad for p in self.model.parameters()], foreach=True)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.model.parameters(), lr=LR)

        def train_dataloader(self) -> DataLoader[Any]:
            batch = batch_size(kind)
            return DataLoader(dataset(kind, steps * batch * devices), batch_size=batch)

    class StepTimer(Callback):
        def __init__(self) -> None:
            self.times: list[float] = []
            self.start = 0.0

        def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any,
                                 batch_idx: int) -> None:
            self.start = time.perf_counter()

        def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any,
                               batch_idx: int) -> None:
            self.times.append(time.perf_counter() - self.start)
            if first_step_marker is not None and len(self.times) == 1:
                print(first_step_marker, flush=True)

    torch.manual_seed(SEED)
    module = Classifier()
    timer = StepTimer()
    trainer = L.Trainer(accelerator="cpu", devices=devices,
                        strategy="ddp" if devices > 1 else "auto", logger=False,
                        enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, max_steps=steps, num_sanity_val_steps=0,
                        callbacks=[timer])
    trainer.fit(module)
    if trainer.global_rank != 0:
        return None
    return {"model": kind, "steps": steps, "devices": devices,
            "lightning_version": L.__version__, "step_times": timer.times,
            "final_weights_sha": weights_sha(module.model),
            "last_grad_norm": float(module.grad_norm)}


def launch(python: str, kind: str, steps: int, devices: int) -> dict[str, Any]:
    """Run the runner with interpreter ``python`` in a subprocess; return its JSON.

    Raises:
        RuntimeError: the runner failed, with its output.
    """
    env = child_env()
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "lightning.json"
        command = [python, "-m", "benchmarks.lightning_steps", "--model", kind,
                   "--steps", str(steps), "--devices", str(devices), "--out", str(out)]
        done = subprocess.run(command, cwd=REPO_ROOT, env=env, capture_output=True, text=True)
        if done.returncode != 0 or not out.exists():
            raise RuntimeError(f"{' '.join(command)} failed ({done.returncode}):\n"
                               f"{done.stdout}{done.stderr}")
        result: dict[str, Any] = json.loads(out.read_text())
    return result


def run(python: str, kind: str, steps: int, devices: int) -> list[float]:
    """Lightning's step times in seconds, trained by interpreter ``python`` in a subprocess."""
    times: list[float] = launch(python, kind, steps, devices)["step_times"]
    return times


def measure(python: str, kind: str = "mlp", steps: int = 300, devices: int = 1,
            trials: int = 5) -> dict[str, Any]:
    """Time Lightning (subprocess) and, on one process, the hand loop, in every trial.

    A trial's figure is the median step after the warm-up; the result holds the medians
    over trials, their spread and, with ``devices=1``, the per-trial ratio Lightning/hand and
    whether the final weights were identical in every trial.
    """
    warmup = min(WARMUP, steps // 2)
    lightning_medians, hand_medians, ratios = [], [], []
    identical = True
    version = ""
    for _ in range(trials):
        if devices == 1:
            hand_times, hand_model = hand_written(kind, steps)
            hand_medians.append(statistics.median(hand_times[warmup:]))
        report = launch(python, kind, steps, devices)
        version = report["lightning_version"]
        lightning_medians.append(statistics.median(report["step_times"][warmup:]))
        if devices == 1:
            ratios.append(lightning_medians[-1] / hand_medians[-1])
            identical &= report["final_weights_sha"] == weights_sha(hand_model)
    result: dict[str, Any] = {
        "model": kind, "steps": steps, "devices": devices, "trials": trials, "warmup": warmup,
        "lightning_version": version,
        "lightning_step_seconds": spread(lightning_medians),
    }
    if devices == 1:
        result.update({"hand_step_seconds": spread(hand_medians),
                       "ratio_lightning_to_hand": spread(ratios),
                       "weights_identical_to_hand": identical})
    return result


def spread(values: list[float]) -> dict[str, float]:
    """Median, min and max of ``values``."""
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def markdown(result: dict[str, Any]) -> list[str]:
    """Table rows ``| what | figure |`` for the benchmark report."""
    processes = "1 CPU process" if result["devices"] == 1 else f"{result['devices']} CPU processes"
    where = f"{result['model']}, {processes}"
    step = result["lightning_step_seconds"]
    rows = [f"| Lightning {result['lightning_version']} median step ({where}) | "
            f"{step['median'] * 1e3:.3f} ms ({step['min'] * 1e3:.3f}-{step['max'] * 1e3:.3f}) |"]
    if "ratio_lightning_to_hand" in result:
        ratio = result["ratio_lightning_to_hand"]
        rows.append(f"| Lightning step / hand-written loop ({where}) | {ratio['median']:.2f} "
                    f"({ratio['min']:.2f}-{ratio['max']:.2f}) |")
        rows.append(f"| Lightning final weights identical to the hand loop ({where}) | "
                    f"{'yes' if result['weights_identical_to_hand'] else 'no'} |")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description="Lightning step-time benchmark")
    parser.add_argument("--model", choices=MODELS, default="mlp")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--devices", type=int, choices=[1, 2], default=1)
    parser.add_argument("--out", type=Path, help="runner mode: write the JSON here (rank 0)")
    parser.add_argument("--python", help="compare mode: the interpreter that has Lightning")
    parser.add_argument("--trials", type=int, default=5)
    args = parser.parse_args()
    if args.python is not None:
        result = measure(args.python, args.model, args.steps, args.devices, args.trials)
        print(json.dumps(result, indent=2))
        print("\n".join(["", "| what | figure |", "|---|---|", *markdown(result)]))
        return
    report = train(args.model, args.steps, args.devices)
    if report is None:
        return
    if args.out is not None:
        args.out.write_text(json.dumps(report))
    else:
        print(json.dumps(report))


if __name__ == "__main__":
    main()
