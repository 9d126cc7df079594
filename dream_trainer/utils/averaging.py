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


class ResultAverager:
    """Mean of every scalar in a sequence of step-result dicts, over batches and ranks.

    ``update`` only stores detached references (no ``.item()``, so no host sync); ``compute``
    does the arithmetic once and averages across every rank with two collectives. Keys may
    differ between steps and ranks: each key is averaged over the steps that produced it.
    Non-scalar values (tensors with more than one element, strings) are ignored.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._pending: dict[str, list[torch.Tensor | float]] = {}
        self._sums: dict[str, torch.Tensor] = {}
        self._counts: dict[str, int] = {}

    def update(self, result: Mapping[str, Any]) -> None:
        for key, value in result.items():
            if isinstance(value, torch.Tensor):
                if value.numel() != 1:
                    continue
                value = value.detach()
            elif isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            pending = self._pending.setdefault(key, [])
            pending.append(value)
            if len(pending) >= _FOLD_EVERY:
                self._fold(key)

    def _fold(self, key: str) -> None:
        values = self._pending.pop(key, [])
        if not values:
            return
        stacked = torch.stack([torch.as_tensor(v, dtype=torch.float64, device=self.device)
                               .reshape(()) for v in values])
        self._sums[key] = self._sums.get(key, torch.zeros((), dtype=torch.float64,
                                                           device=self.device)) + stacked.sum()
        self._counts[key] = self._counts.get(key, 0) + len(values)

    def compute(self) -> dict[str, float]:
        """Return ``{key: mean}`` over all updates of every rank (a collective when launched)."""
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
        totals = torch.stack(
            [self._sums.get(key, zero) for key in keys]
            + [torch.tensor(float(self._counts.get(key, 0)), dtype=torch.float64,
                            device=self.device) for key in keys]
        )
        if distributed:
            dist.all_reduce(totals)
        sums, counts = totals[: len(keys)].tolist(), totals[len(keys):].tolist()
        return {key: (s / c if c else math.nan) for key, s, c in zip(keys, sums, counts)}
