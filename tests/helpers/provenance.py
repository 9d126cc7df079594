"""A toy trainer with a layer that turns non-finite on one chosen micro-batch, for NanGuard's
diagnosis: in forward (``Boom``), or in backward only (``SqrtAtZero``)."""

from __future__ import annotations

import copy
import random
from typing import Any, Literal

import torch
from torch import nn

from dream_trainer.callbacks import Callback
from dream_trainer.parallel.names import unwrap_ddp
from tests.helpers.toy import ToyTrainer


class Faulty(nn.Module):
    """A linear layer followed, while ``armed``, by this module's own fault."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.inner = nn.Linear(dim, dim)
        self.armed = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inner(x)
        return self.fault(x) if self.armed else x

    def fault(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


class Boom(Faulty):
    """Multiplies its child's output past float32's range: the child's output stays finite,
    its own does not."""

    def fault(self, x: torch.Tensor) -> torch.Tensor:
        return x * 1e39


class SqrtAtZero(Faulty):
    """Adds ``sqrt(x - x)``: zero in forward, NaN in backward (the derivative of sqrt at 0 is
    infinite, and the two infinite halves cancel to NaN)."""

    def fault(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.sqrt(x - x)


class ProvenanceTrainer(ToyTrainer):
    """The toy trainer, whose model has the faulty layer at ``model.1.1`` (inside a parent
    ``Sequential``, with a child ``inner``), armed on micro-batch ``bad_batch`` of rank
    ``bad_rank``; an in-place ReLU, batch norm and dropout around it."""

    fault: Literal["forward", "backward"] = "forward"
    bad_batch: int = -1
    bad_rank: int = 0

    def configure_models(self) -> None:
        c = self.config
        faulty = Boom(c.hidden) if self.fault == "forward" else SqrtAtZero(c.hidden)
        self.model = nn.Sequential(nn.Linear(c.in_features, c.hidden),
                                   nn.Sequential(nn.ReLU(inplace=True), faulty),
                                   nn.BatchNorm1d(c.hidden), nn.Dropout(0.25),
                                   nn.Linear(c.hidden, c.out_features))

    def training_step(self, batch: Any, batch_idx: int) -> dict[str, Any]:
        faulty = unwrap_ddp(self.model)[1][1]
        faulty.armed = batch_idx == self.bad_batch and self.world.rank == self.bad_rank
        return super().training_step(batch, batch_idx)


class RecordBatch(Callback):
    """A copy of the micro-batch ``batch_idx`` as ``training_step`` received it."""

    def __init__(self, batch_idx: int) -> None:
        self.batch_idx = batch_idx
        self.batch: Any = None

    def pre_train_batch(self, batch: Any, batch_idx: int) -> None:
        if batch_idx == self.batch_idx:
            self.batch = [t.clone() for t in batch]


class TrainingState(Callback):
    """The training state at ``pre_optimizer_step`` of global step ``step`` (registered
    before NanGuard: before its diagnosis) and when fit fails (after the diagnosis)."""

    def __init__(self, step: int) -> None:
        self.step = step
        self.before: dict[str, Any] | None = None
        self.after: dict[str, Any] | None = None

    def pre_optimizer_step(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        if self.trainer.global_step == self.step:
            self.before = training_state(self.trainer)

    def on_exception(self, exception: BaseException) -> None:
        self.after = training_state(self.trainer)


def training_state(trainer: Any) -> dict[str, Any]:
    model = unwrap_ddp(trainer.model)
    modules = list(model.modules())
    return {
        "tensors": {k: v.detach().clone() for k, v in model.state_dict().items()},
        "grads": {k: (id(p.grad), None if p.grad is None else p.grad.clone())
                  for k, p in model.named_parameters()},
        "optimizer": copy.deepcopy(trainer.optimizer.state_dict()),
        "cpu_rng": torch.get_rng_state(),
        "cuda_rng": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        "python_rng": random.getstate(),
        "training": [m.training for m in modules],
        "attributes": [(sorted(vars(m)), getattr(m, "armed", None)) for m in modules],
        "hooks": sum(len(m._forward_hooks) + len(m._forward_pre_hooks)
                     + len(m._backward_hooks) for m in modules)
        + sum(len(p._backward_hooks or {}) for p in model.parameters()),
        "counters": (trainer.global_step, trainer.local_batches, trainer.current_epoch),
    }


def same_bits(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    """Equal tensors, NaN included (``torch.equal`` says NaN != NaN)."""
    if a is None or b is None:
        return a is b
    return a.dtype == b.dtype and torch.equal(a.reshape(-1).view(torch.uint8),
                                              b.reshape(-1).view(torch.uint8))


def assert_same_state(before: dict[str, Any], after: dict[str, Any]) -> None:
    for key, tensor in before["tensors"].items():
        assert same_bits(tensor, after["tensors"][key]), key
    for key, (grad_id, grad) in before["grads"].items():
        after_id, after_grad = after["grads"][key]
        assert after_id == grad_id and same_bits(grad, after_grad), key
    for index, state in before["optimizer"]["state"].items():
        for name, value in state.items():
            assert torch.equal(value, after["optimizer"]["state"][index][name]), (index, name)
    assert torch.equal(before["cpu_rng"], after["cpu_rng"])
    for cuda_before, cuda_after in zip(before["cuda_rng"], after["cuda_rng"], strict=True):
        assert torch.equal(cuda_before, cuda_after)
    for key in ("python_rng", "training", "attributes", "hooks", "counters"):
        assert before[key] == after[key], key
