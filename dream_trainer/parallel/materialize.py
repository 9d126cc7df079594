"""Turning meta-device models into real, initialized ones, sharded or not."""

from __future__ import annotations

import contextlib
import itertools
import math
from collections.abc import Callable, Collection, Iterable
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from dream_trainer.parallel.dtensor import is_dtensor, local_tensor
from dream_trainer.parallel.hf_init import init_hf_models
from dream_trainer.parallel.lora import init_peft_adapters
from dream_trainer.parallel.names import clean_name

_CHECK_ELEMENTS = 2**22  # 16 MiB of float32 per isfinite call
_RANDOM_FILLS = frozenset({"uniform_", "normal_", "bernoulli_", "random_", "exponential_",
                           "geometric_", "log_normal_", "cauchy_"})


class FullTensorInit(TorchFunctionMode):
    """Run in-place initializers of DTensors on the full tensor, then keep the local shard.

    On a CPU mesh DTensor random ops draw only the local shard from the (identically seeded)
    generator, so every rank would get the same values and none would match a single-process
    run. Under this mode a random fill or ``torch.nn.init`` function applied to a DTensor runs
    on a full-size plain tensor, consuming the generator exactly as one process would; each
    rank then keeps its slice. Peak extra memory is one tensor's full size.

    Args:
        skip: Tensors whose random initializers are not run at all (sharded or not): ones
            about to be overwritten, such as parameters loaded from pretrained weights.
            Constant fills (``nn.init.ones_`` calls ``fill_`` directly) still run.
    """

    def __init__(self, skip: Iterable[torch.Tensor] = ()) -> None:
        super().__init__()
        self._skip = {id(tensor): tensor for tensor in skip}

    def __torch_function__(self, func: Callable[..., Any], types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        target = args[0] if args else kwargs.get("tensor")
        is_initializer = getattr(func, "__name__", None) in _RANDOM_FILLS \
            or getattr(func, "__module__", None) == "torch.nn.init"
        if is_initializer and id(target) in self._skip:
            return target
        if not (is_initializer and is_dtensor(target)):
            return func(*args, **kwargs)
        from torch.distributed.tensor import distribute_tensor  # loaded: target is one

        local = target.to_local()
        full = torch.empty(target.shape, dtype=target.dtype, device=local.device)
        if args:
            func(full, *args[1:], **kwargs)
        else:
            func(**{**kwargs, "tensor": full})
        shard = distribute_tensor(full, target.device_mesh, target.placements,
                                  src_data_rank=None).to_local()
        with torch.no_grad():
            local.copy_(shard)
        return target


def has_meta_tensors(module: nn.Module) -> bool:
    """True when any parameter or buffer of ``module`` has no storage yet."""
    return any(t.is_meta for t in itertools.chain(module.parameters(), module.buffers()))


def parameters_named(module: nn.Module, names: Collection[str]) -> list[torch.Tensor]:
    """The parameters of ``module`` whose names (as ``get_model_state_dict`` keys them,
    without wrapper attributes) are in ``names``."""
    return [param for name, param in module.named_parameters(remove_duplicate=False)
            if clean_name(name) in names]


def materialize(module: nn.Module, device: torch.device, skip: Collection[str] = (),
                values: bool = True) -> None:
    """Allocate ``module`` on ``device`` and run every submodule's ``reset_parameters``.

    Floating tensors are filled with NaN between allocation and reset, so that a tensor no
    initializer touched is caught by ``find_uninitialized`` instead of training on garbage.
    Submodules are reset in ``modules()`` order, the order in which eager construction runs
    them, and under ``FullTensorInit``, so sharded and unsharded models get the same weights
    from the same seed. A Hugging Face ``PreTrainedModel`` then gets its library's own
    initialization (see ``init_hf_models``), as its ``post_init`` does after construction.
    Parameters shared by several modules (tied embeddings) stay shared.

    Args:
        module: The model, on the meta device (sharded or not).
        device: Where its tensors go.
        skip: Names of parameters not to initialize (see ``parameters_named``): pretrained
            weights are about to overwrite them, so neither time nor a full-size temporary
            tensor is spent on them. They hold NaN until then.
        values: False for tensors without values (a ``Materialization`` whose
            ``has_values`` is False): the initializers run as they are, on shapes only.
    """
    tied = _tied_parameters(module)
    module.to_empty(device=device)
    _retie(tied)
    if values:
        with torch.no_grad():
            for tensor in itertools.chain(module.parameters(), module.buffers()):
                if tensor.is_floating_point():
                    tensor.fill_(math.nan)
    # Without values a sharded draw would split a full-size tensor for nothing.
    full = FullTensorInit(skip=parameters_named(module, skip) if skip else ()) if values \
        else contextlib.nullcontext()
    with full:
        for submodule in module.modules():
            reset_module(submodule)
        init_hf_models(module)
        init_peft_adapters(module)


def reset_module(module: nn.Module) -> None:
    """Run ``module``'s own ``reset_parameters()`` (not its children's), if its class has
    one.

    Looked up on the class: a wrapper (``checkpoint_wrapper``, ``torch.compile``) forwards
    unknown attributes to the block it wraps, whose reset would then run twice, drawing
    other initial weights than the same run without activation checkpointing or compilation.
    """
    # torch's own nn.MultiheadAttention only has the private name.
    for name in ("reset_parameters", "_reset_parameters"):
        reset = getattr(type(module), name, None)
        if callable(reset):
            reset(module)
            return


def _tied_parameters(module: nn.Module) -> list[list[tuple[nn.Module, str]]]:
    """The (owner, attribute) pairs of every parameter that more than one place holds."""
    owners: dict[int, list[tuple[nn.Module, str]]] = {}
    for submodule in module.modules():
        for name, param in submodule.named_parameters(recurse=False, remove_duplicate=False):
            owners.setdefault(id(param), []).append((submodule, name))
    return [places for places in owners.values() if len(places) > 1]


def _retie(tied: list[list[tuple[nn.Module, str]]]) -> None:
    """Share each tied parameter again: ``to_empty`` from the meta device gives every
    attribute a new ``Parameter`` (FSDP2's swap keeps them shared, plain modules do not)."""
    for (first_owner, first_name), *others in tied:
        shared = getattr(first_owner, first_name)
        for owner, name in others:
            if getattr(owner, name) is not shared:
                setattr(owner, name, shared)


def find_uninitialized(name: str, module: nn.Module,
                       skip: Iterable[torch.Tensor] = ()) -> list[str]:
    """Names of parameters/buffers of ``module`` still on meta or holding non-finite values.

    Only this rank's shards are inspected; combine ranks with ``agree_any``. Tensors in
    ``skip`` (left for pretrained weights to fill) are not inspected.
    """
    bad = []
    skipped = {id(tensor) for tensor in skip}
    named = itertools.chain(module.named_parameters(), module.named_buffers())
    for tensor_name, tensor in named:
        if id(tensor) in skipped:
            continue
        local = local_tensor(tensor)
        if local.is_meta:
            bad.append(f"{name}.{tensor_name} (still on the meta device)")
        elif local.is_floating_point() and not _all_finite(local):
            bad.append(f"{name}.{tensor_name} (not initialized: NaN or inf)")
    return bad


def _all_finite(tensor: torch.Tensor) -> bool:
    """``isfinite(tensor).all()`` a slice at a time: on a whole tensor ``isfinite`` makes
    temporaries about twice its size (an absolute-value copy and two masks)."""
    flat = tensor.detach().reshape(-1)
    return all(bool(torch.isfinite(chunk).all()) for chunk in flat.split(_CHECK_ELEMENTS))
