"""Two helpers a Hugging Face Trainer user would otherwise write by hand: parameter groups
without weight decay for norms and biases, and a warmup-then-decay learning-rate schedule."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, Literal

import torch
from torch import nn
from torch.optim.lr_scheduler import LambdaLR

__all__ = ["warmup_decay_schedule", "weight_decay_groups"]

_NORMS = (nn.LayerNorm, nn.GroupNorm, nn.LocalResponseNorm, nn.RMSNorm,
          nn.modules.batchnorm._NormBase)


def _is_norm(module: nn.Module) -> bool:
    # transformers' LlamaRMSNorm and its siblings are not torch classes: known by name.
    return isinstance(module, _NORMS) or "Norm" in type(module).__name__


def weight_decay_groups(model: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """The model's trainable parameters in two optimizer groups: ``weight_decay`` for weights,
    none for the rest.

    A parameter decays unless it is held by a normalization layer (a torch norm module, or any
    module whose class name contains ``Norm``, such as ``LlamaRMSNorm``), its name ends with
    ``bias``, or it has fewer than 2 dimensions. Embeddings and linear weights decay. Frozen
    parameters are left out; a parameter shared by several modules (tied embeddings) appears
    once, and decays unless one of its holders says otherwise.

    Args:
        model: The model (wrapped or not: only its parameters and modules are read).
        weight_decay: The decay of the first group.

    Returns:
        ``[{"params": decayed, "weight_decay": weight_decay}, {"params": rest,
        "weight_decay": 0.0}]``, for any ``torch.optim`` optimizer.
    """
    exempt: set[int] = set()
    for module in model.modules():
        for name, param in module.named_parameters(recurse=False):
            if _is_norm(module) or name.endswith("bias") or param.ndim < 2:
                exempt.add(id(param))
    decayed, rest = [], []
    for param in model.parameters():  # each shared parameter once
        if param.requires_grad:
            (rest if id(param) in exempt else decayed).append(param)
    return [{"params": decayed, "weight_decay": weight_decay},
            {"params": rest, "weight_decay": 0.0}]


def warmup_decay_schedule(optimizer: torch.optim.Optimizer, warmup_steps: int,
                          total_steps: int | Callable[[], int],
                          decay: Literal["cosine", "linear", "constant"] = "cosine",
                          min_lr_ratio: float = 0.0) -> LambdaLR:
    """A schedule of the learning rate: linear warmup from 0, then a decay to
    ``min_lr_ratio`` times the base rate at ``total_steps``.

    The factor at step ``s`` is ``s / warmup_steps`` during warmup, then, with ``p`` the
    fraction of the decay done, ``0.5 * (1 + cos(pi * p))`` (cosine), ``1 - p`` (linear) or 1
    (constant), blended as ``factor * (1 - min_lr_ratio) + min_lr_ratio``; with
    ``min_lr_ratio=0`` these are Hugging Face's ``get_cosine_schedule_with_warmup`` and
    ``get_linear_schedule_with_warmup``, value for value.

    Args:
        optimizer: The optimizer whose groups' ``lr`` are the base rates.
        warmup_steps: Optimizer steps of warmup (0: none).
        total_steps: Optimizer steps of the whole run, or a function returning them, read
            when the decay first needs it (``lambda: self.total_train_steps`` in
            ``configure_schedulers``, where the run's length is not yet planned).
        decay: The shape after warmup.
        min_lr_ratio: The factor the decay ends at.

    Returns:
        A ``LambdaLR``; step it once per optimizer step (``step()`` does, when configured).

    Raises:
        ValueError: for negative steps, an unknown ``decay`` or a ratio outside [0, 1].
    """
    if warmup_steps < 0:
        raise ValueError(f"warmup_steps must be >= 0, got {warmup_steps}")
    if decay not in ("cosine", "linear", "constant"):
        raise ValueError(f"decay={decay!r}: expected 'cosine', 'linear' or 'constant'")
    if not 0.0 <= min_lr_ratio <= 1.0:
        raise ValueError(f"min_lr_ratio must be in [0, 1], got {min_lr_ratio}")

    def checked(steps: int) -> int:
        if steps < warmup_steps:
            raise ValueError(f"total_steps={steps} is less than warmup_steps={warmup_steps}: "
                             "shorten the warmup")
        return steps

    total: list[int] = [] if callable(total_steps) else [checked(total_steps)]

    def total_now() -> int:
        if not total:
            total.append(checked(total_steps()))  # type: ignore[operator]
        return total[0]

    def factor(step: int) -> float:
        # The arithmetic of transformers' schedules, operation for operation.
        if step < warmup_steps:
            return float(step) / float(max(1, warmup_steps))
        if decay == "constant" or (step == warmup_steps and not total):
            shape = 1.0  # a lazy run length is read once the decay is under way
        elif decay == "cosine":
            progress = float(step - warmup_steps) / float(max(1, total_now() - warmup_steps))
            shape = 0.5 * (1.0 + math.cos(math.pi * progress))
        else:
            shape = float(total_now() - step) / float(max(1, total_now() - warmup_steps))
        return max(0.0, shape * (1.0 - min_lr_ratio) + min_lr_ratio)

    return LambdaLR(optimizer, factor)
