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
Scalars = list[tuple[str, Number]]
"""A step result's averaged entries: ``(key, value)`` pairs, as ``scalars`` returns them."""


def scalars(result: Mapping[str, Any]) -> Scalars:
    """The entries of ``result`` that are averaged: numbers and one-element tensors, the
    tensors that require gradients detached (no ``.item()``, so no host sync). Non-scalar
    values (tensors with more than one element, strings, bools) are left out."""
    values: Scalars = []
    for key, value in result.items():
        if isinstance(value, torch.Tensor):
            if value.numel() != 1:
                continue
            if value.requires_grad:  # a tensor that requires none holds no graph
                value = value.detach()
        elif isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        values.append((key, value))
    return values


class ResultAverager:
    """Weighted means of every scalar in a sequence of step-result dicts, over steps and ranks.

    Each step's values count with the step's weight (its batch size, or its item count), so
    that an epoch's mean is the mean over samples, as one process computing it over the whole
    set would have it: a smaller last batch counts for what it holds. ``update`` only stores
    references (see ``scalars``); ``compute`` does the arithmetic once and combines every rank
    with two collectives. Keys may differ between steps and ranks: each key is averaged over
    the steps that produced it. The value of ``WEIGHT_KEY`` is summed, not averaged.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._pending: list[tuple[Scalars, Number]] = []
        self._sums: dict[str, torch.Tensor] = {}
        self._weights: dict[str, torch.Tensor] = {}
        self._seen: dict[str, None] = {}  # keys in the order they first came (an ordered set)

    def update(self, result: Mapping[str, Any], weight: Number = 1.0) -> None:
        """Add one step's results, each value counting ``weight`` times.

        A step of weight 0 contributes nothing, even if its values are NaN.
        """
        self.add(scalars(result), weight)

    def add(self, values: Scalars, weight: Number = 1.0) -> None:
        """``update`` with the step's ``scalars`` already taken (a caller feeding several
        averagers takes them once)."""
        self._pending.append((values, weight))
        if len(self._pending) >= _FOLD_EVERY:
            self._fold()

    def _fold(self) -> None:
        steps, self._pending = self._pending, []
        if not steps:
            return
        columns: dict[str, tuple[list[int], list[Number]]] = {}
        for index, (values, _) in enumerate(steps):
            for key, value in values:
                column = columns.get(key)
                if column is None:
                    column = columns[key] = ([], [])
                column[0].append(index)
                column[1].append(value)
        weights = self._column([weight for _, weight in steps])
        zero = torch.zeros((), dtype=torch.float64, device=self.device)
        for key, (indices, column_values) in columns.items():
            self._seen.setdefault(key)
            values = self._column(column_values)
            if key == WEIGHT_KEY:  # summed: each of its values counts once
                weighted, key_weights = values, torch.ones_like(values)
            else:
                key_weights = weights if len(indices) == len(steps) else \
                    weights[torch.tensor(indices, device=self.device)]
                weighted = torch.where(key_weights == 0, torch.zeros_like(values),
                                       values * key_weights)
            self._sums[key] = self._sums.get(key, zero) + weighted.sum()
            self._weights[key] = self._weights.get(key, zero) + key_weights.sum()

    def _column(self, items: list[Number]) -> torch.Tensor:
        """``items`` as one float64 vector on the device: one conversion for numbers, or for
        tensors of one dtype, device and shape (the usual column), else one per item."""
        first = items[0]
        if not isinstance(first, torch.Tensor):
            if not any(isinstance(item, torch.Tensor) for item in items):
                return torch.tensor(items, dtype=torch.float64, device=self.device)
        elif all(isinstance(item, torch.Tensor) and item.dtype == first.dtype
                 and item.device == first.device and item.shape == first.shape
                 for item in items):
            return torch.stack(items).reshape(-1).to(self.device, torch.float64)
        return torch.stack([torch.as_tensor(item, dtype=torch.float64, device=self.device)
                            .reshape(()) for item in items])

    def compute(self) -> dict[str, float]:
        """Return ``{key: weighted mean}`` over all updates of every rank (``WEIGHT_KEY``:
        the total), a collective when launched."""
        self._fold()
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
