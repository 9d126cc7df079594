"""Averaging step results over an epoch and across ranks without a host sync per step."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

# Pending scalars are folded into running sums every this many updates, bounding memory on
# long epochs while keeping the per-step cost to a list append.
_FOLD_EVERY = 256

WEIGHT_KEY = "num_items"
"""A result key that gives its step's weight (the count its values are means over); the epoch
result holds its total instead of its mean."""

Number = torch.Tensor | float


class ResultAverager:
    """Weighted means of every scalar in a sequence of step-result dicts, over steps and ranks.

    Each step's values count with the step's weight (its batch size, or its item count), so
    that an epoch's mean is the mean over samples, as one process computing it over the whole
    set would have it: a smaller last batch counts for what it holds. ``update`` only stores
    detached references (no ``.item()``, so no host sync); ``compute`` does the arithmetic once
    and combines every rank with two collectives. Keys may differ between steps and ranks:
    each key is averaged over the steps that produced it. Non-scalar values (tensors with more
    than one element, strings) are ignored. The value of ``WEIGHT_KEY`` is summed, not
    averaged.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._pending: dict[str, list[tuple[Number, Number]]] = {}
        self._sums: dict[str, torch.Tensor] = {}
        self._weights: dict[str, torch.Tensor] = {}
        self._seen: dict[str, None] = {}  # keys in the order they first came (an ordered set)

    def update(self, result: Mapping[str, Any], weight: Number = 1.0) -> None:
        """Add one step's results, each value counting ``weight`` times.

        A step of weight 0 contributes nothing, even if its values are NaN.
        """
        for key, value in result.items():
            if isinstance(value, torch.Tensor):
                if value.numel() != 1:
                    continue
                value = value.detach()
            elif isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            self._seen.setdefault(key)
            pending = self._pending.setdefault(key, [])
            pending.append((value, 1.0) if key == WEIGHT_KEY else (value, weight))
            if len(pending) >= _FOLD_EVERY:
                self._fold(key)

    def _fold(self, key: str) -> None:
        pairs = self._pending.pop(key, [])
        if not pairs:
            return
        values, weights = (torch.stack([self._scalar(v) for v in column])
                           for column in zip(*pairs))
        weighted = torch.where(weights == 0, torch.zeros_like(values), values * weights)
        zero = torch.zeros((), dtype=torch.float64, device=self.device)
        self._sums[key] = self._sums.get(key, zero) + weighted.sum()
        self._weights[key] = self._weights.get(key, zero) + weights.sum()

    def _scalar(self, value: Number) -> torch.Tensor:
        return torch.as_tensor(value, dtype=torch.float64, device=self.device).reshape(())

    def compute(self) -> dict[str, float]:
        """Return ``{key: weighted mean}`` over all updates of every rank (``WEIGHT_KEY``:
        the total), a collective when launched."""
        for key in list(self._pending):
            self._fold(key)
        keys = sorted(self._sums)
        distributed = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
        if distributed:
            gathered: list[list[str] | None] = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, keys)
            keys = sorted({key for rank_keys in gathered for key in rank_keys or ()})
        if not keys:
            return {}
        zero = torch.zeros((), dtype=torch.float64, device=self.device)
        totals = torch.stack([self._sums.get(key, zero) for key in keys]
                             + [self._weights.get(key, zero) for key in keys])
        if distributed:
            dist.all_reduce(totals)
        sums, weights = totals[: len(keys)].tolist(), totals[len(keys):].tolist()
        means = {key: (s if key == WEIGHT_KEY else s / w if w else math.nan)
                 for key, s, w in zip(keys, sums, weights)}
        # The ranks agreed on sorted keys; hand them back in the order this rank first saw them
        # (the user's order in the result dict), so loggers' columns follow it.
        return {key: means[key] for key in [*self._seen, *(k for k in keys if k not in self._seen)]}
