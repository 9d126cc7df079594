"""How much work decoding one checkpoint pickle may cost: a budget proportional to its bytes.

A pickle's memo lets a few bytes name one value many times: 64 tuples of two references to
the previous one take a kilobyte and expand to 2**64 values. Python does not cache a tuple's
hash, so hashing such a key, copying such a state or moving such a tree's tensors visits
every expanded value, and never ends. The decoder therefore charges every value it (or its
caller) will visit, counting each reference again, as torch's and Python's own code visits
it: before it hashes tuple keys, before a builder checks or copies a state or arguments
(an object built from a state counts what that state was charged), and once on the final
value of a ``torch.save`` archive, which bounds what readers do with it afterwards (move
its tensors to a device, put packed tensors back). DCP's metadata needs no final walk: its
top object is built from a state charged with everything it holds. A DAG or a cycle is
cut off as soon as the budget is spent, so charging costs at most the budget.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Iterator
from typing import Any

import torch

from dream_trainer.checkpoint.allowlist import Refusal

EXPANSION = 16
"""Values a pickle may expand to per byte of it, summed over every charge. Real checkpoints
charge at most 0.27 per byte (measured on the suite's checkpoints of plain, resharded and
MoE runs: metadata, tensors, optimizer states, packed trainer state) and 0.44 for the
metadata of an FSDP2 run of 2,400 to 9,600 chunks (``benchmarks.metadata_decode``), so 16
leaves a margin of over 30; a crafted file costs at most 16 values per byte (microseconds
per byte) instead of forever."""
BASE_VALUES = 4096
"""Values any pickle may expand to besides ``EXPANSION`` per byte: a tiny pickle of a few
shared values is honest."""
MAX_DEPTH = 256
"""Deepest nesting of containers accepted (real states nest about 10 deep); deeper ones would
overflow the interpreter's stack when hashed, compared or copied."""

_FLAT = frozenset({int, float, bool, type(None), complex})
_TEXT_UNIT = 64
"""Bytes of a string counted as one value: builders copy or scan strings (a shared one
encoded again by every reference would multiply memory as well as time)."""
_SEQUENCES = (list, tuple, set, frozenset)
_NAMES = frozenset({str, int})  # the keys of nearly every dict: nothing inside to charge


class Budget:
    """The values one decode of ``size`` bytes may still visit (``EXPANSION`` per byte plus
    ``BASE_VALUES``), charged by ``charge`` and ``walk``."""

    __slots__ = ("limit", "size", "left", "built", "kept")

    def __init__(self, size: int) -> None:
        self.size = size
        self.limit = self.left = EXPANSION * size + BASE_VALUES
        self.built: dict[int, int] = {}  # what each built object expands to, by id
        self.kept: list[Any] = []  # those objects, alive so that their ids stay theirs

    def charge(self, items: Collection[Any]) -> int:
        """Charge ``items`` and everything inside them, every reference counted: dicts, lists,
        tuples and sets are opened, an object ``record``ed counts what it was built from,
        any other value (a tensor, a number) is one value.

        Returns:
            What was charged.

        Raises:
            Refusal: once the budget is spent.
        """
        start = self.left
        left = start - len(items)
        built = self.built
        stack: list[Iterable[Any]] = [items]
        while stack:
            for value in stack.pop():
                kind = type(value)
                if kind in _FLAT:
                    continue
                if kind is tuple or kind is list:
                    left -= len(value)
                    stack.append(value)
                elif kind is torch.Size:  # only ints: its builder checked them
                    left -= len(value)
                elif kind is str or kind is bytes or kind is bytearray:
                    left -= len(value) // _TEXT_UNIT
                elif isinstance(value, dict):
                    left -= 2 * len(value)
                    if not _NAMES.issuperset(map(type, value)):
                        stack.append(value.keys())
                    stack.append(value.values())
                elif isinstance(value, _SEQUENCES):
                    left -= len(value)
                    stack.append(value)
                else:
                    left -= built.get(id(value), 0)
                if left < 0:
                    raise self.spent()
        self.left = left
        if left < 0:
            raise self.spent()
        return start - left

    def record(self, value: Any, charged: int) -> None:
        """Note that ``value`` was built from a state ``charge`` charged ``charged`` for:
        a reference to it costs as much again wherever it is charged."""
        self.built[id(value)] = charged
        self.kept.append(value)

    def walk(self, root: Any, children: Callable[[Any], Iterator[Any] | None]) -> None:
        """Charge the final result ``root``, opening what ``children`` opens (dataclasses
        too), and refuse containers nested more than ``MAX_DEPTH`` deep (a cycle among them).

        Raises:
            Refusal: once the budget is spent, too deep, or what ``children`` refuses.
        """
        left = self.left - 1
        stack: list[tuple[Iterable[Any], int]] = [((root,), 0)]
        while stack:
            items, depth = stack.pop()
            for value in items:
                kind = type(value)
                if kind in _FLAT:
                    continue
                if kind is dict:
                    inner: Collection[Any] = [*value.keys(), *value.values()]
                elif kind is list or kind is tuple:
                    inner = value
                else:
                    opened = children(value)
                    if opened is None:
                        continue
                    inner = list(opened)
                if depth >= MAX_DEPTH:
                    raise Refusal(f"containers nested more than {MAX_DEPTH} deep (or a "
                                  "container that holds itself)")
                left -= len(inner)
                if left < 0:
                    self.left = left
                    raise self.spent()
                stack.append((inner, depth + 1))
        self.left = left

    def spent(self) -> Refusal:
        """The refusal once the budget is spent."""
        return Refusal(f"values that expand to more than {self.limit} objects from "
                       f"{self.size} bytes ({EXPANSION} per byte + {BASE_VALUES}): shared "
                       "references crafted to make reading it take hours")

