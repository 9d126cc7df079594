"""Bytes held by tensors: storages on the local shards, and the live-memory peak of a step."""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch._subclasses.fake_tensor import is_fake
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from dream_trainer.parallel.dtensor import local_tensor


def storages(tensors: Iterable[Any]) -> dict[int, torch.UntypedStorage]:
    """The distinct storages under ``tensors`` (DTensors by their local shard), by identity.

    Views and tied parameters share a storage, so it is counted once; FSDP2's padded shard
    storage is larger than the shard it shows, and its size is what the device holds.
    """
    found: dict[int, torch.UntypedStorage] = {}
    for tensor in tensors:
        if isinstance(tensor, torch.Tensor):
            storage = local_tensor(tensor).untyped_storage()
            found[id(storage)] = storage
    return found


def storage_bytes(tensors: Iterable[Any]) -> int:
    """Bytes of the distinct storages under ``tensors``."""
    return sum(storage.nbytes() for storage in storages(tensors).values())


def optimizer_tensors(optimizer: torch.optim.Optimizer) -> Iterator[torch.Tensor]:
    """Every tensor in ``optimizer.state`` (moments, step counters, ...)."""
    for state in optimizer.state.values():
        yield from (value for value in state.values() if isinstance(value, torch.Tensor))


class StepMemory(TorchDispatchMode):
    """Follow every storage created while active, and replay the live bytes to find a peak.

    Each op's outputs are recorded with their storage size, and each storage's release is
    recorded when Python frees it. FSDP2 allocates and frees unsharded parameters by resizing
    their storage, which no dispatch mode sees, so ``UntypedStorage.resize_`` is wrapped
    while active (and restored after). ``peak(excluding=...)`` then replays the timeline
    without the storages that are reported elsewhere (gradients, optimizer state).

    DTensor ops are let through to be split into their local ops, which are recorded; the
    global-size tensors DTensor fakes to propagate shapes are not.
    """

    def __init__(self) -> None:
        super().__init__()
        self._ids = itertools.count()
        self._live: dict[int, tuple[int, int]] = {}  # id(storage) -> (allocation, bytes)
        self._events: list[tuple[int, int]] = []  # (allocation, change in bytes)
        self._refs: dict[int, weakref.ref[torch.UntypedStorage]] = {}  # their release callbacks
        self._original_resize: Callable[..., Any] = torch.UntypedStorage.resize_
        self._original_lock: Any = None
        self._propagating = 0  # > 0 while DTensor propagates shapes on global-size fakes

    def allocation_of(self, storage: torch.UntypedStorage) -> int | None:
        """The allocation number of a storage created while tracking and still alive."""
        entry = self._live.get(id(storage))
        return entry[0] if entry is not None else None

    def peak(self, excluding: Iterable[int] = ()) -> int:
        """The largest sum of live bytes reached, leaving out the given allocations."""
        skip = set(excluding)
        live = peak = 0
        for allocation, change in self._events:
            if allocation not in skip:
                live += change
                peak = max(peak, live)
        return peak

    def live_bytes(self, excluding: Iterable[int] = ()) -> int:
        """The bytes of the storages created while tracking and alive now, leaving out the
        given allocations."""
        skip = set(excluding)
        return sum(size for allocation, size in self._live.values() if allocation not in skip)

    def _track_storage(self, storage: torch.UntypedStorage) -> None:
        key = id(storage)
        if key in self._live:
            return
        allocation, size = next(self._ids), storage.nbytes()
        self._live[key] = (allocation, size)
        self._events.append((allocation, size))
        self._refs[allocation] = weakref.ref(
            storage, lambda _, key=key, allocation=allocation: self._release(key, allocation))

    def _release(self, key: int, allocation: int) -> None:
        del self._refs[allocation]
        entry = self._live.get(key)
        if entry is not None and entry[0] == allocation:
            del self._live[key]
            self._events.append((allocation, -entry[1]))

    def _resized(self, storage: torch.UntypedStorage, before: int) -> None:
        entry = self._live.get(id(storage))
        if entry is None:
            if before == 0 and storage.nbytes() > 0:
                self._track_storage(storage)  # emptied before tracking began, filled now
            return
        allocation, _ = entry
        self._live[id(storage)] = (allocation, storage.nbytes())
        self._events.append((allocation, storage.nbytes() - before))

    def __enter__(self) -> StepMemory:
        original = self._original_resize = torch.UntypedStorage.resize_

        def resize_(storage: torch.UntypedStorage, size: int) -> Any:
            before = storage.nbytes()
            result = original(storage, size)
            self._resized(storage, before)
            return result

        torch.UntypedStorage.resize_ = resize_  # type: ignore[method-assign]
        self._watch_sharding_propagation()
        return super().__enter__()  # type: ignore[no-any-return]

    def __exit__(self, *args: Any) -> None:
        try:
            super().__exit__(*args)
        finally:
            torch.UntypedStorage.resize_ = self._original_resize  # type: ignore[method-assign]
            if self._original_lock is not None:
                from torch.distributed.tensor._sharding_prop import ShardingPropagator

                ShardingPropagator._fake_mode_lock = self._original_lock

    def _watch_sharding_propagation(self) -> None:
        """DTensor works out each op's output shape by running it on global-size tensors in
        the active fake mode, which here is the plan's: those tensors are metadata, not this
        rank's memory (on a GPU they are fake too). DTensor enters the class attribute
        ``_fake_mode_lock`` (a ``nullcontext`` unless tests make it a lock) around exactly
        that, so it is wrapped to mark the span."""
        from torch.distributed.tensor._sharding_prop import ShardingPropagator

        lock = self._original_lock = ShardingPropagator._fake_mode_lock
        tracker = self

        class _Propagating:
            def __enter__(self) -> None:
                lock.__enter__()
                tracker._propagating += 1

            def __exit__(self, *args: Any) -> None:
                tracker._propagating -= 1
                lock.__exit__(*args)

        ShardingPropagator._fake_mode_lock = _Propagating()

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        from torch.distributed.tensor import DTensor

        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented
        if func is torch.ops._c10d_functional.wait_tensor.default and is_fake(args[0]):
            # Eager wait_tensor returns its input; the fake kernel returns a new tensor, which
            # would count a collective's output twice.
            return args[0]
        out = func(*args, **(kwargs or {}))
        if self._propagating:
            return out
        outputs = [out] if isinstance(out, torch.Tensor) else \
            [leaf for leaf in tree_leaves(out) if isinstance(leaf, torch.Tensor)]
        if outputs:
            # An output on an input's storage (a view, an in-place op) allocated nothing; a
            # view of a parameter would otherwise be counted as a new tensor of its size.
            inputs = {id(leaf.untyped_storage()) for leaf in tree_leaves((args, kwargs))
                      if isinstance(leaf, torch.Tensor)}
            for leaf in outputs:
                storage = leaf.untyped_storage()
                if id(storage) not in inputs:
                    self._track_storage(storage)
        return out
