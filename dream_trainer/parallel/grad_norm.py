"""Total gradient norm and clipping that hold for plain and DTensor parameters."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn
from torch.distributed.tensor import DTensor


def clip_grad_norm(parameters: Iterable[nn.Parameter], max_norm: float | None) -> torch.Tensor:
    """Return the total 2-norm of the gradients, clipping them to ``max_norm`` if given.

    The norm is a 0-dim tensor on the gradients' device: nothing forces a host sync. With
    DTensor (FSDP2/TP) gradients the local norms are reduced over their mesh, so the value is
    the norm of the full gradient on every rank.
    """
    params = [p for p in parameters if p.grad is not None]
    if not params:
        return torch.zeros(())
    grads = [p.grad for p in params]
    total = torch.nn.utils.get_total_norm(grads, norm_type=2.0, foreach=True)
    if isinstance(total, DTensor):
        total = total.full_tensor()
    if max_norm is not None:
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total, foreach=True)
    return total
