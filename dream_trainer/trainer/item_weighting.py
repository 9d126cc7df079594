"""Token-weighted gradients: the update of the mean over every item of the global batch."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
import torch.distributed as dist
from torch import nn

from dream_trainer.parallel.dtensor import local_tensor


class ItemWeighting:
    """Counts the items (valid tokens, say) behind the summed losses of one accumulation
    window, and rescales the window's gradients to the mean over every item of every rank.

    ``backward(loss, num_items=n)`` backpropagates a loss that is a *sum* over ``n`` items,
    unscaled. Data-parallel gradient reduction (DDP, FSDP2, HSDP) averages over the ``D``
    data-parallel ranks, so after the window's last backward the gradient is
    ``sum_of_item_gradients / D``; multiplying it by ``D / N``, where ``N`` is the window's
    item count summed over the micro-batches and the data-parallel ranks, gives the gradient
    of the mean over all ``N`` items. ``N`` is one scalar all-reduce per optimizer step, kept
    on the device: nothing waits for the host.

    A window is either weighted (every backward passes ``num_items``) or not (none does).
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._local: torch.Tensor | None = None
        self._global: torch.Tensor | None = None
        self._unweighted_backwards = 0
        self.last_num_items: torch.Tensor | None = None
        """The ``num_items`` of the latest weighted backward of this micro-batch, if any."""
        self.active = False
        """True when the current window's losses are weighted by item counts (an attribute,
        not a property: ``step()`` reads it every step)."""

    def start_window(self) -> None:
        """Forget the previous window's counts (called before its first micro-batch)."""
        self._local = self._global = None
        self._unweighted_backwards = 0
        self.last_num_items = None
        self.active = False

    def start_micro_batch(self) -> None:
        self.last_num_items = None

    def add(self, num_items: int | torch.Tensor) -> None:
        """Count ``num_items`` more items in this window.

        Raises:
            ValueError: if the window already had a backward without ``num_items``, or if
                ``num_items`` is not a count.
        """
        if self._unweighted_backwards:
            raise ValueError(self._mixed_message())
        count = _as_count(num_items, self.device)
        self._local = count if self._local is None else self._local + count
        self.active = True
        self.last_num_items = count if self.last_num_items is None \
            else self.last_num_items + count

    def note_unweighted(self) -> None:
        """Record a backward without ``num_items``.

        Raises:
            ValueError: if the window already had a weighted backward.
        """
        if self._local is not None:
            raise ValueError(self._mixed_message())
        self._unweighted_backwards += 1

    def global_count(self, group: dist.ProcessGroup | None) -> torch.Tensor:
        """The window's items over every data-parallel rank (one all-reduce per window)."""
        if self._local is None:
            raise RuntimeError("no backward(loss, num_items=...) in this window")
        if self._global is None:
            total = self._local.clone()
            if group is not None and dist.get_world_size(group) > 1:
                dist.all_reduce(total, group=group)
            self._global = total
        return self._global

    def add_peer_counts(self, group: dist.ProcessGroup | None,
                        reduce: Callable[[torch.Tensor], None]) -> None:
        """Add the counts of peers outside the data-parallel mesh to this window's count.

        Fault-tolerant replica groups each reduce over their own mesh and add up their
        gradients across groups; ``reduce`` sums the window's count across the groups in
        place, so that ``scale_gradients`` divides by the items of every live group. Call it
        after the window's last backward, before ``step()`` scales the gradients.
        """
        reduce(self.global_count(group))

    def scale_gradients(self, parameters: Iterable[nn.Parameter],
                        group: dist.ProcessGroup | None, dp_size: int) -> torch.Tensor:
        """Multiply every gradient by ``dp_size / N``; return ``N``.

        A window without any item (all padding) has zero gradients; its count is taken as 1
        so that nothing becomes NaN.
        """
        total = self.global_count(group)
        factor = dp_size / total.clamp_min(1)
        by_device: dict[torch.device, list[torch.Tensor]] = {}
        for param in parameters:
            if param.grad is not None:
                grad = local_tensor(param.grad)
                by_device.setdefault(grad.device, []).append(grad)
        for device, grads in by_device.items():
            # In place on a float32 gradient a float64 0-dim factor keeps the gradient's dtype.
            torch._foreach_mul_(grads, factor.to(device))
        return total

    @staticmethod
    def _mixed_message() -> str:
        return ("backward() was called with and without num_items in one accumulation window: "
                "a loss summed over its items and a mean loss cannot be combined into one "
                "update; pass num_items to every backward() of the window, or to none")


def _as_count(num_items: int | torch.Tensor, device: torch.device) -> torch.Tensor:
    if isinstance(num_items, torch.Tensor):
        if num_items.numel() != 1:
            raise ValueError(f"num_items must be a count (one number), got a tensor of shape "
                             f"{tuple(num_items.shape)}")
        return num_items.detach().reshape(()).to(device=device, dtype=torch.float64)
    if isinstance(num_items, bool) or not isinstance(num_items, int) or num_items < 0:
        raise ValueError(f"num_items must be a non-negative int or a 0-dim tensor, got "
                         f"{num_items!r}")
    return torch.tensor(float(num_items), dtype=torch.float64, device=device)
