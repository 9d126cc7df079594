"""``transformers`` decoders under context parallelism: what they need beyond attention through
torch's SDPA, so that they train split without user code.

A transformers model is given only this rank's part of each sequence, and builds what it
builds from positions as if that part were the whole:

- its rotary embedding counts positions from 0: a hook maps them to the positions held;
- its attention masks (causal, sliding-window) are built over the local part: the attention
  function it calls (transformers' ``"sdpa"`` entry) is wrapped while a split is active, to
  drop the local mask and hand the layer's ``sliding_window`` to the gathered attention,
  which applies the window by global position. Dropping the mask is exact only when the
  model was given no padding, so a model called with an ``attention_mask`` that masks any
  position is refused (on every rank alike: the ranks add up their parts' masked positions);
- attention implementations other than ``"sdpa"`` (eager, flash, flex) do not call
  ``F.scaled_dot_product_attention``, so they would attend within the local part only: they
  are refused when the layout is bound.

``transformers`` is never imported here: its modules are recognized by their package, and
its attention registry is patched only when transformers already loaded it.
"""

from __future__ import annotations

import contextlib
import inspect
import sys
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from dream_trainer.parallel.context_attention import GatheredAttention
from dream_trainer.parallel.context_split import SequenceSplit

Tensors = tuple[Any, ...]


def is_hf_rotary(module: nn.Module) -> bool:
    """A transformers rotary embedding (``forward(x, position_ids)``)."""
    kind = type(module)
    return kind.__module__.startswith("transformers.") \
        and kind.__name__.endswith("RotaryEmbedding")


def is_hf_model(module: nn.Module) -> bool:
    """A transformers model (its config names an attention implementation), also once FSDP2
    or compilation changed its class."""
    return any(kind.__module__.startswith("transformers.") for kind in type(module).__mro__) \
        and hasattr(getattr(module, "config", None), "_attn_implementation")


def hf_class_name(module: nn.Module) -> str:
    """The name of the transformers class of ``module`` (not FSDP2's subclass of it)."""
    return next((kind.__name__ for kind in type(module).__mro__
                 if kind.__module__.startswith("transformers.")), type(module).__name__)


def check_attention(models: Mapping[str, nn.Module], ranks: int) -> None:
    """Refuse a transformers model whose attention does not run through torch's SDPA.

    Raises:
        ValueError: naming the model, its ``attn_implementation`` and the fix.
    """
    for name, model in models.items():
        for module in model.modules():
            if not is_hf_model(module):
                continue
            implementation = module.config._attn_implementation
            if implementation not in (None, "sdpa"):
                raise ValueError(
                    f"under context_parallel={ranks} attention runs through torch's "
                    f"scaled_dot_product_attention over the whole sequence, but the model "
                    f"{name!r} ({hf_class_name(module)}) uses attn_implementation="
                    f"{implementation!r}, which would attend within this rank's part only: "
                    "build it with attn_implementation='sdpa'")


class HFDecoders:
    """The hooks a split needs on the transformers modules of a run's models.

    Args:
        models: The built models.
        ranks: ``context_parallel``, for messages.
        active: The split now active (None outside ``ContextParallel.split``).
        group: The ``cp`` process group.
    """

    def __init__(self, models: Mapping[str, nn.Module], ranks: int,
                 active: Callable[[], SequenceSplit | None],
                 group: Callable[[], dist.ProcessGroup],
                 document_positions: Callable[[], torch.Tensor | None] = lambda: None
                 ) -> None:
        self.ranks, self.active, self.group = ranks, active, group
        self.document_positions = document_positions
        modules = [module for model in models.values() for module in model.modules()]
        self.handles = [module.register_forward_pre_hook(self._global_positions,
                                                         with_kwargs=True)
                        for module in modules if is_hf_rotary(module)]
        self.handles += [module.register_forward_pre_hook(self._no_padding, with_kwargs=True)
                         for model in models.values() for module in _outermost_models(model)]
        self.found = bool(self.handles)

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []

    @contextlib.contextmanager
    def attention(self, gathered: GatheredAttention) -> Iterator[None]:
        """transformers' ``"sdpa"`` attention function wrapped until the context exits: the
        layer's local mask dropped (SDPA then runs causal) and its ``sliding_window`` set on
        ``gathered`` for the call."""
        modeling = sys.modules.get("transformers.modeling_utils")
        registry = getattr(getattr(modeling, "AttentionInterface", None), "_global_mapping",
                           None)
        if not self.found or registry is None or "sdpa" not in registry:
            yield
            return
        original = registry["sdpa"]

        def sdpa(module: nn.Module, query: torch.Tensor, key: torch.Tensor,
                 value: torch.Tensor, attention_mask: torch.Tensor | None, *args: Any,
                 **kwargs: Any) -> Any:
            window = kwargs.get("sliding_window")
            gathered.window = window if isinstance(window, int) and window > 0 else None
            try:
                return original(module, query, key, value, None, *args, **kwargs)
            finally:
                gathered.window = None

        registry["sdpa"] = sdpa
        try:
            yield
        finally:
            registry["sdpa"] = original

    def _global_positions(self, module: nn.Module, args: Tensors,
                          kwargs: dict[str, Any]) -> tuple[Tensors, dict[str, Any]] | None:
        """The rotary embedding's ``position_ids`` (local indices) as the positions held, or,
        with packed documents, as those positions' places in their documents."""
        split = self.active()
        if split is None:
            return None
        local = kwargs["position_ids"] if "position_ids" in kwargs else args[1]
        held = split.local[local]
        documents = self.document_positions()
        if documents is not None:
            documents = documents.to(held.device)
            held = documents.gather(1, held.expand(documents.size(0), -1))
        if "position_ids" in kwargs:
            return args, {**kwargs, "position_ids": held}
        return (args[0], held, *args[2:]), kwargs

    def _no_padding(self, module: nn.Module, args: Tensors, kwargs: dict[str, Any]) -> None:
        """Refuse an ``attention_mask`` that masks a position: the masks the model builds
        from it are dropped under the split (see the module docstring)."""
        if self.active() is None:
            return
        mask = kwargs.get("attention_mask")
        if mask is None and args:
            index = _mask_index(type(module))
            mask = args[index] if index is not None and index < len(args) else None
        if not isinstance(mask, torch.Tensor):
            return
        # Summed over the ranks, so that every rank refuses when one part holds the padding
        # (the others would wait for it in the next collective).
        masked = (mask == 0).sum().to(torch.int64).reshape(1)
        dist.all_reduce(masked, group=self.group())
        if masked.item():
            raise ValueError(
                f"under context_parallel={self.ranks} {hf_class_name(module)} was called with "
                f"an attention_mask that masks {masked.item()} positions (padding), but a split "
                "sequence attends by position only: pack the sequences to one length without "
                "padding and pass attention_mask=None")


def _outermost_models(model: nn.Module) -> list[nn.Module]:
    """The transformers models in ``model`` that no other one holds (a causal LM, not also
    the decoder inside it: the mask is checked once per call)."""
    found: list[str] = []
    modules = []
    for name, module in model.named_modules():
        if is_hf_model(module) and not any(name.startswith(f"{outer}.") or not outer
                                           for outer in found):
            found.append(name)
            modules.append(module)
    return modules


_MASK_INDEX: dict[type, int | None] = {}


def _mask_index(kind: type) -> int | None:
    """Where ``forward`` of ``kind`` takes ``attention_mask`` among its positional arguments."""
    if kind not in _MASK_INDEX:
        names = [name for name in inspect.signature(kind.forward).parameters if name != "self"]
        _MASK_INDEX[kind] = names.index("attention_mask") if "attention_mask" in names else None
    return _MASK_INDEX[kind]
