"""``Histograms``: weight and gradient histograms of every parameter, every N steps."""

from __future__ import annotations

import torch
from torch import nn
from typing_extensions import override

from dream_trainer.mixins.logging import LoggerMixin
from dream_trainer.parallel.dtensor import is_dtensor
from dream_trainer.parallel.names import canonical_name
from dream_trainer.trainer.callback import Callback

class Histograms(Callback[LoggerMixin]):
    """Log the distribution of every trainable parameter and its gradient every
    ``every_n_steps`` optimizer steps, as ``weights/<model>/<parameter>`` and
    ``gradients/<model>/<parameter>`` (``trainer.log_histogram``).

    They are taken in ``pre_optimizer_step`` when ``global_step`` (the optimizer steps done)
    is a multiple of ``every_n_steps``, step 0 included, and logged at that step: the weights
    after ``global_step`` updates and the gradients computed on them, before clipping (and,
    with float16, before unscaling). Only models passed to ``step()`` are seen. Sharded
    parameters (FSDP2, tensor parallel: DTensors) are gathered with ``full_tensor()`` on every
    rank, one parameter at a time, so the histograms are of the whole tensors, not of rank
    0's shards; rank 0 then logs them. Attach it on every rank (it is no ``RankZeroCallback``:
    the gathers are collectives).

    Args:
        every_n_steps: Log when ``global_step`` is a multiple of this.
        weights: Log the parameters' values.
        gradients: Log their gradients (parameters without one are skipped).

    Raises:
        ValueError: if ``every_n_steps < 1`` or neither ``weights`` nor ``gradients``.
    """

    trainer: LoggerMixin

    def __init__(self, every_n_steps: int = 100, weights: bool = True,
                 gradients: bool = True) -> None:
        if every_n_steps < 1:
            raise ValueError(f"Histograms every_n_steps must be at least 1, got {every_n_steps}")
        if not (weights or gradients):
            raise ValueError("Histograms with weights=False and gradients=False logs nothing: "
                             "turn one on, or remove the callback")
        self.every_n_steps = every_n_steps
        self.weights = weights
        self.gradients = gradients

    @override
    def pre_optimizer_step(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        trainer = self.trainer
        if trainer.global_step % self.every_n_steps:
            return
        model_name = next((name for name, candidate in trainer.named_models().items()
                           if candidate is model), type(model).__name__)
        log = trainer.world.is_rank_zero
        # Every rank walks the same parameters in the same order: each gather is a collective.
        for name, param in model.named_parameters():
            if not param.requires_grad:
                continue
            key = f"{model_name}/{canonical_name(model, name)}"
            if self.weights:
                values = _full(param)
                if log:
                    trainer.log_histogram(f"weights/{key}", values)
            if self.gradients and param.grad is not None:
                values = _full(param.grad)
                if log:
                    trainer.log_histogram(f"gradients/{key}", values)


def _full(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor: a DTensor gathered from its shards (a collective), else itself."""
    with torch.no_grad():
        return tensor.full_tensor() if is_dtensor(tensor) else tensor.detach()

