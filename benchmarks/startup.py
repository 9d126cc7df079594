"""Import time and time to the first training step, each in fresh subprocesses.

Every figure is the time from launching a child to the arrival of the line it prints once
its work is done, so interpreter shutdown (0.5-1 s once torch is loaded) is left out.

Imports: ``python -c "import torch"``, ``"import dream_trainer"`` (which imports torch)
and, given Lightning's interpreter, ``"import lightning"``, minus the median of ``python -c
"pass"`` with the same interpreter. The variants run in turn within each of ``repeats``
rounds, so machine noise hits all alike; the ratio dream_trainer/torch is taken per round
(goal: at most 1.10).

First step: ``python -m benchmarks.startup --first-step VARIANT`` trains the
``step_overhead`` workload and prints its line once the first optimizer step has finished.
Variants: (a) the hand-written loop, (b) ``BaseTrainer`` + ``SetupMixin``, (c)
``DreamTrainer`` with its default callbacks (checkpoints and logs in a temporary directory)
and, given its interpreter, Lightning. The figure covers interpreter start, imports, config
validation, process-group start, model build and one step.

This module imports only the standard library at the top: the children import what their
variant needs, and the Lightning child runs in an environment without dream_trainer.

    python -m benchmarks.startup [--repeats 5] [--lightning-python /tmp/lightning-venv/bin/python]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.processes import REPO_ROOT, child_env

MARKER = "benchmarks.startup: reached"
IMPORT_GOAL = 1.10
VARIANTS = ("hand", "base", "dream", "lightning")
TINY_STEP = ("model = torch.nn.Linear(8, 8); model(torch.zeros(2, 8)).sum().backward(); "
             "torch.optim.AdamW(model.parameters()).step()")


def time_to_marker(command: list[str]) -> float:
    """Seconds from launching ``command`` to the arrival of its ``MARKER`` line.

    The clock stops at the marker, not at exit: an interpreter that has loaded torch takes
    another 0.5-1 s to tear its modules down, which no training run waits for.

    Raises:
        RuntimeError: the child failed or exited without printing the marker, with its output.
    """
    start = time.perf_counter()
    child = subprocess.Popen(command, cwd=REPO_ROOT, env=child_env(), stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True)
    assert child.stdout is not None
    lines = []
    elapsed = None
    for line in child.stdout:
        if elapsed is None and line.strip() == MARKER:
            elapsed = time.perf_counter() - start
        lines.append(line)
    if child.wait() != 0 or elapsed is None:
        raise RuntimeError(f"{' '.join(command)} exited {child.returncode} without "
                           f"{MARKER!r}:\n{''.join(lines)}")
    return elapsed


def time_import(python: str, statement: str) -> float:
    """Seconds from launching ``python`` to the end of ``statement`` (``pass`` or an import)."""
    return time_to_marker([python, "-c", f"{statement}; print({MARKER!r}, flush=True)"])


def time_to_first_step(python: str, variant: str, workdir: Path) -> float:
    """Seconds from launching the ``variant`` child to the end of its first optimizer step."""
    return time_to_marker([python, "-m", "benchmarks.startup", "--first-step", variant,
                           "--workdir", str(workdir)])


def spread(values: list[float]) -> dict[str, float]:
    """Median, min and max of ``values``."""
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def measure_imports(repeats: int = 5, lightning_python: str | None = None) -> dict[str, Any]:
    """Import times above bare interpreter start, and the ratios to ``import torch``.

    ``ratio_dream_trainer_to_torch`` is the goal's figure. ``ratio_ready_to_train`` adds one
    AdamW step of a tiny model after each import: torch's first optimizer step imports
    ``torch._dynamo`` (and sympy), much of which dream_trainer's import loads up front, so
    this is what the import costs a training script. ``lightning`` is measured with its own
    interpreter against that interpreter's start and ``import torch``.
    """
    here = [("torch", "import torch"), ("dream_trainer", "import dream_trainer"),
            ("torch_ready_to_train", f"import torch; {TINY_STEP}"),
            ("dream_trainer_ready_to_train", f"import dream_trainer, torch; {TINY_STEP}")]
    jobs = {sys.executable: [("python", "pass"), *here]}
    if lightning_python is not None:
        jobs[lightning_python] = [("python", "pass"), ("torch", "import torch"),
                                  ("lightning", "import lightning")]
    runs: dict[tuple[str, str], list[float]] = {}
    for _ in range(repeats):
        for python, statements in jobs.items():
            for name, statement in statements:
                runs.setdefault((python, name), []).append(time_import(python, statement))

    def above_start(python: str, name: str) -> list[float]:
        start = statistics.median(runs[python, "python"])
        return [t - start for t in runs[python, name]]

    def ratio(python: str, name: str, reference: str) -> dict[str, float]:
        return spread([a / b for a, b in zip(above_start(python, name),
                                             above_start(python, reference))])

    imports = {name: spread(above_start(sys.executable, name)) for name, _ in here}
    result: dict[str, Any] = {
        "repeats": repeats,
        "interpreter_start_seconds": spread(runs[sys.executable, "python"]),
        "import_seconds": imports,
        "ratio_dream_trainer_to_torch": ratio(sys.executable, "dream_trainer", "torch"),
        "ratio_ready_to_train": ratio(sys.executable, "dream_trainer_ready_to_train",
                                      "torch_ready_to_train"),
        "goal": IMPORT_GOAL}
    result["meets_goal"] = result["ratio_dream_trainer_to_torch"]["median"] <= IMPORT_GOAL
    if lightning_python is not None:
        imports["lightning"] = spread(above_start(lightning_python, "lightning"))
        result["ratio_lightning_to_torch"] = ratio(lightning_python, "lightning", "torch")
    return result


def measure_first_step(repeats: int = 5,
                       lightning_python: str | None = None) -> dict[str, Any]:
    """Seconds from process launch to the end of the first optimizer step, per variant."""
    pythons = {"hand": sys.executable, "base": sys.executable, "dream": sys.executable}
    if lightning_python is not None:
        pythons["lightning"] = lightning_python
    runs: dict[str, list[float]] = {name: [] for name in pythons}
    with tempfile.TemporaryDirectory() as tmp:
        for round_index in range(repeats):
            for name, python in pythons.items():
                workdir = Path(tmp) / f"{name}{round_index}"
                runs[name].append(time_to_first_step(python, name, workdir))
    ratios = {name: spread([t / hand for t, hand in zip(runs[name], runs["hand"])])
              for name in pythons if name != "hand"}
    return {"repeats": repeats, "seconds": {name: spread(v) for name, v in runs.items()},
            "ratio_to_hand": ratios}


def measure(repeats: int = 5, lightning_python: str | None = None) -> dict[str, Any]:
    """Both figures: ``measure_imports`` and ``measure_first_step``."""
    return {"imports": measure_imports(repeats, lightning_python),
            "first_step": measure_first_step(repeats, lightning_python)}


def markdown(result: dict[str, Any]) -> list[str]:
    """Table rows ``| what | figure |`` for the benchmark report."""
    def figure(values: dict[str, float], scale: float = 1.0, unit: str = "") -> str:
        return (f"{values['median'] * scale:.2f}{unit} "
                f"({values['min'] * scale:.2f}-{values['max'] * scale:.2f})")

    imports, first = result["imports"], result["first_step"]
    labels = {"torch": "`import torch`", "dream_trainer": "`import dream_trainer`",
              "torch_ready_to_train": "`import torch` + a tiny AdamW step",
              "dream_trainer_ready_to_train": "`import dream_trainer` + a tiny AdamW step",
              "lightning": "`import lightning`"}
    rows = [f"| {labels[name]} above interpreter start | {figure(values, unit=' s')} |"
            for name, values in imports["import_seconds"].items()]
    rows.append(f"| `import dream_trainer` / `import torch` (goal <= {imports['goal']:.2f}) | "
                f"{figure(imports['ratio_dream_trainer_to_torch'])} |")
    rows.append(f"| the same, each followed by a tiny AdamW step | "
                f"{figure(imports['ratio_ready_to_train'])} |")
    if "ratio_lightning_to_torch" in imports:
        rows.append(f"| `import lightning` / `import torch` | "
                    f"{figure(imports['ratio_lightning_to_torch'])} |")
    names = {"hand": "hand-written loop", "base": "BaseTrainer", "dream": "DreamTrainer",
             "lightning": "Lightning"}
    for name, values in first["seconds"].items():
        rows.append(f"| launch to first step, {names[name]} | {figure(values, unit=' s')} |")
    for name, values in first["ratio_to_hand"].items():
        rows.append(f"| launch to first step, {names[name]} / hand-written loop | "
                    f"{figure(values)} |")
    return rows


def first_step(variant: str, workdir: Path) -> None:
    """In the child: train the ``mlp`` workload for one step, then print ``MARKER``."""
    if variant == "hand":
        from benchmarks.workloads import hand_written

        hand_written("mlp", 1)
        print(MARKER, flush=True)
    elif variant == "lightning":
        from benchmarks.lightning_steps import train

        train("mlp", 1, first_step_marker=MARKER)
    else:
        trainer_first_step(variant, workdir)


def trainer_first_step(variant: str, workdir: Path) -> None:
    """(b) or (c): a dream_trainer subclass that prints ``MARKER`` after its first step."""
    import torch
    import torch.nn.functional as F
    from torch.utils.data import DataLoader

    from benchmarks.workloads import BATCH, LR, SEED, build_model, dataset
    from dream_trainer import BaseTrainer, BaseTrainerConfig, DreamTrainer, DreamTrainerConfig
    from dream_trainer.configs import (CheckpointParameters, DeviceParameters,
                                       LoggingParameters, TrainingParameters)
    from dream_trainer.mixins import SetupConfigMixin, SetupMixin

    class OneStep:
        def configure_models(self) -> None:
            self.model = build_model("mlp")

        def configure_optimizers(self) -> None:
            self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=LR)

        def configure_dataloaders(self) -> tuple[DataLoader[Any], None]:
            return DataLoader(dataset("mlp", BATCH), batch_size=BATCH), None

        def training_step(self, batch: Any, batch_idx: int) -> dict[str, Any]:
            x, y = batch
            loss = F.cross_entropy(self.model(x), y)
            self.backward(loss)  # type: ignore[attr-defined]
            grad_norm = self.step(self.model, self.optimizer)  # type: ignore[attr-defined]
            return {"loss": loss, "grad_norm": grad_norm}

        def validation_step(self, batch: Any, batch_idx: int) -> dict[str, Any]:
            return {}

        def post_train_batch(self, result: dict[str, Any], batch_idx: int) -> None:
            super().post_train_batch(result, batch_idx)  # type: ignore[misc]
            if batch_idx == 0:
                print(MARKER, flush=True)

    class BaseOneStep(OneStep, BaseTrainer, SetupMixin):
        pass

    class BaseOneStepConfig(BaseTrainerConfig, SetupConfigMixin):
        pass

    class DreamOneStep(OneStep, DreamTrainer):
        pass

    common: dict[str, Any] = {
        "project": "bench", "group": "startup", "experiment": variant, "seed": SEED,
        "device_parameters": DeviceParameters.SINGLE_DEVICE(),
        "training_parameters": TrainingParameters(n_epochs=1, train_batch_size=BATCH)}
    if variant == "base":
        BaseOneStep(BaseOneStepConfig(**common)).fit()
    else:
        DreamOneStep(DreamTrainerConfig(
            **common, checkpoint_parameters=CheckpointParameters(root_dir=workdir),
            logging_parameters=LoggingParameters(log_dir=workdir))).fit()


def main() -> None:
    parser = argparse.ArgumentParser(description="import and first-step time benchmark")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--lightning-python", help="the interpreter that has Lightning")
    parser.add_argument("--first-step", choices=VARIANTS, help=argparse.SUPPRESS)
    parser.add_argument("--workdir", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.first_step is not None:
        first_step(args.first_step, args.workdir)
        return
    result = measure(args.repeats, args.lightning_python)
    print(json.dumps(result, indent=2))
    print("\n".join(["", "| what | figure |", "|---|---|", *markdown(result)]))


if __name__ == "__main__":
    main()
