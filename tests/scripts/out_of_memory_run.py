"""Script (2 ranks): rank 1 runs out of memory in one phase; rank 0 must end by itself.

Usage: out_of_memory_run.py OUT_DIR PHASE. The run checkpoints every 2 steps and fails at
global step 3 on rank 1 only. Every rank writes ``rank<R>.json``: the error it ended with, the
failure messages it logged, when it ended and (rank 1) when the error was injected, and the
checkpoint files (name, size, digest) before the injection and after the failure.

One phase per launch: a rank's failure ends its peers when its process exits (the peer's
collective then fails), so a process that went on to a second run would leave its peer
waiting for the collective timeout.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from dream_trainer.configs import CheckpointParameters, TrainingParameters
from dream_trainer.mixins import CheckpointConfigMixin, CheckpointMixin
from tests.helpers.toy import ToyConfig, ToyTrainer

FAIL_AT = 3  # the global step of the failure; checkpoints at steps 2 and 4
CPU_ALLOCATION = 2**50  # bytes: more than any address space, so malloc refuses at once


class Config(ToyConfig, CheckpointConfigMixin):
    phase: str = "forward"


def _digests(root: Path) -> list[list[Any]]:
    return [[str(path.relative_to(root)), path.stat().st_size,
             hashlib.sha256(path.read_bytes()).hexdigest()]
            for path in sorted(root.rglob("*")) if path.is_file() and "lock" not in path.name]


class RunsOutOfMemory(ToyTrainer, CheckpointMixin):
    config: Config

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.injected_at: float | None = None
        self.before: list[list[Any]] = []

    def _due(self, phase: str) -> bool:
        due = (self.world.rank == 1 and self.config.phase == phase
               and self.global_step == FAIL_AT - (phase != "validation"))
        if due:
            self.before = _digests(Path(self.config.checkpoint_parameters.root_dir))
            self.injected_at = time.time()
        return due

    def training_step(self, batch: Any, batch_idx: int) -> dict[str, Any]:
        x, y = batch
        if self._due("forward"):
            raise torch.OutOfMemoryError("CUDA out of memory (injected in forward)")
        if self._due("cpu_allocator"):
            torch.empty(CPU_ALLOCATION, dtype=torch.uint8)
        out = self.model(x)
        if self._due("backward"):
            def fail(grad: torch.Tensor) -> torch.Tensor:
                raise torch.OutOfMemoryError("CUDA out of memory (injected in backward)")
            out.register_hook(fail)
        loss = F.mse_loss(out, y)
        self.backward(loss)
        return {"loss": loss, "grad_norm": self.step(self.model, self.optimizer)}

    def apply_update(self, optimizer: torch.optim.Optimizer) -> None:
        if self._due("optimizer"):
            raise torch.OutOfMemoryError("CUDA out of memory (injected in the optimizer step)")
        super().apply_update(optimizer)

    def validation_step(self, batch: Any, batch_idx: int) -> dict[str, Any]:
        if batch_idx == 0 and self._due("validation"):
            raise torch.OutOfMemoryError("CUDA out of memory (injected in validation)")
        return super().validation_step(batch, batch_idx)


class Messages(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def run(phase: str, root: Path, messages: Messages) -> dict[str, Any]:
    config = Config(project="oom", group="tests", experiment=phase, phase=phase, n_samples=160,
                    training_parameters=TrainingParameters(n_epochs=2, train_batch_size=4,
                                                           val_every_n_steps=1,
                                                           val_steps_per_epoch=2),
                    checkpoint_parameters=CheckpointParameters(root_dir=root / phase,
                                                               every_n_steps=2,
                                                               every_n_epochs=None))
    trainer = RunsOutOfMemory(config)
    messages.messages.clear()
    error = "none"
    try:
        trainer.fit()
    except BaseException as exc:  # the run's failure is the result
        error = f"{type(exc).__name__}: {exc}"
    ended = time.time()
    checkpoints = root / phase
    return {"error": error, "messages": list(messages.messages), "ended": ended,
            "injected_at": trainer.injected_at, "before": trainer.before,
            "after": _digests(checkpoints) if checkpoints.exists() else []}


if __name__ == "__main__":
    out, phase = Path(sys.argv[1]), sys.argv[2]
    handler = Messages()
    logging.getLogger("dream_trainer.trainer.base").addHandler(handler)
    results = run(phase, out, handler)
    rank = int(os.environ["RANK"])
    (out / f"rank{rank}.json").write_text(json.dumps(results))
