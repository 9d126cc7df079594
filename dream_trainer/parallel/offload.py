"""Activation offloading: the tensors a block saves for backward are copied to host memory
during its forward and brought back for backward, through torch's saved-tensor hooks
(``torch.autograd.graph.saved_tensors_hooks``).

``offload_blocks`` wraps each block (``find_blocks``) in an ``OffloadWrapper`` (torch's
``ActivationWrapper``, so names and checkpoints lose the wrapper's segment as they do for the
checkpoint wrapper) whose forward runs under an ``ActivationOffload``. Outside a block that
torch checkpoints, the wrapper offloads what the checkpoint keeps (the block's inputs);
inside, torch's own hooks replace these and recompute instead.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import ActivationWrapper
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from dream_trainer.parallel.blocks import find_blocks


@dataclass
class OffloadStats:
    """What an ``ActivationOffload`` did, in bytes of the tensors' elements, since it was
    made (counters only grow)."""

    packed_bytes: int = 0
    """Every tensor autograd saved in the blocks' forward (a tensor saved twice counts
    twice)."""
    offloaded_bytes: int = 0
    """Copied to host memory: each distinct saved activation once per forward."""
    kept_bytes: int = 0
    """Left where they were: parameters (and views of them), which the device holds
    anyway, and tensor subclasses (DTensor, float8), whose copy would not be theirs."""
    restored_bytes: int = 0
    """Brought back for backward, once per unpack (a copy two operations saved comes back
    twice); on the CPU the copy itself is handed back, the host being the device."""

    def add(self, other: OffloadStats) -> OffloadStats:
        """The sum of both counts, as a new ``OffloadStats``."""
        return OffloadStats(*(getattr(self, field) + getattr(other, field)
                              for field in self.__dataclass_fields__))


def _is_parameter(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is a leaf that trains, or a view of one (``weight.t()``)."""
    base = tensor._base if tensor._base is not None else tensor
    return base.is_leaf and base.requires_grad


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


class ActivationOffload(torch.autograd.graph.saved_tensors_hooks):
    """Saved-tensor hooks that pack each saved activation as a host copy and unpack it onto
    its device again; on CUDA the copies go to pinned memory on a side stream.

    Originals stay referenced until the context exits, so that a tensor saved by several
    operations is copied once, a CUDA copy finishes before its source is freed, and an
    address freed inside the block cannot alias a later tensor.
    """

    def __init__(self, stats: OffloadStats | None = None) -> None:
        self.stats = stats if stats is not None else OffloadStats()
        self._copies: dict[tuple[Any, ...], tuple[torch.Tensor, torch.Tensor]] = {}
        self._stream: Any = None
        super().__init__(self._pack, self._unpack)

    def __enter__(self) -> None:
        self._copies = {}
        super().__enter__()

    def __exit__(self, *exc: object) -> None:
        super().__exit__(*exc)
        if self._stream is not None:
            # Later work on the main stream may reuse the originals' memory once they are
            # released: it must wait for the copies that read them.
            torch.cuda.current_stream().wait_stream(self._stream)
        self._copies = {}

    def _pack(self, tensor: torch.Tensor) -> Any:
        size = _nbytes(tensor)
        self.stats.packed_bytes += size
        if is_traceable_wrapper_subclass(tensor) or _is_parameter(tensor):
            self.stats.kept_bytes += size
            return tensor
        key = (tensor.untyped_storage()._cdata, tensor.storage_offset(), tensor.shape,
               tensor.stride(), tensor.dtype, tensor.device)
        if key not in self._copies:
            self._copies[key] = (tensor, self._to_host(tensor))
            self.stats.offloaded_bytes += size
        return tensor.device, self._copies[key][1]

    def _to_host(self, tensor: torch.Tensor) -> torch.Tensor:
        """A host copy of ``tensor``: pinned and asynchronous on CUDA, plain elsewhere."""
        if tensor.device.type != "cuda":
            return tensor.detach().clone()
        if self._stream is None:
            self._stream = torch.cuda.Stream(tensor.device)
        host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        self._stream.wait_stream(torch.cuda.current_stream(tensor.device))
        with torch.cuda.stream(self._stream):
            host.copy_(tensor, non_blocking=True)
        return host

    def _unpack(self, packed: Any) -> torch.Tensor:
        if isinstance(packed, torch.Tensor):
            return packed
        device, host = packed
        self.stats.restored_bytes += _nbytes(host)
        if device.type == "cpu":
            return host
        return host.to(device, non_blocking=True)


class OffloadWrapper(ActivationWrapper):
    """Runs the wrapped module under its own ``ActivationOffload``, whose ``stats`` count
    what it moved."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__(module)
        self.offload = ActivationOffload()

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        with self.offload:
            return self._checkpoint_wrapped_module(*args, **kwargs)


def offload_blocks(model: nn.Module) -> int:
    """Wrap every block of ``model`` (``find_blocks``, checkpointed or not) in an
    ``OffloadWrapper``, in place.

    Returns:
        How many blocks were wrapped.
    """
    blocks = find_blocks(model)
    for container, name, block in blocks:
        setattr(container, name, OffloadWrapper(block))
    return len(blocks)


def offload_stats(model: nn.Module) -> OffloadStats:
    """The sum of the ``stats`` of every ``OffloadWrapper`` in ``model``."""
    total = OffloadStats()
    for module in model.modules():
        if isinstance(module, OffloadWrapper):
            total = total.add(module.offload.stats)
    return total
