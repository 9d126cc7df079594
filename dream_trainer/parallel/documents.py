"""Attention that stays inside each packed document, for any model that calls torch's SDPA.

Inside ``documents(document_ids, position_ids)`` (``StepAPI.documents``) every call of
``F.scaled_dot_product_attention`` over the packed sequence attends only within each
query's document: a causal call becomes block-causal by document, a non-causal one
block-diagonal. On CUDA the rule runs through FlexAttention with a block mask built from
the document ids (compiled: blocks between documents are skipped and no ``seq x seq`` mask
is held). Elsewhere (the CPU, where FlexAttention has no backward), and on CUDA with dropout
or with a mask the model passes itself, the boolean mask (``batch x 1 x seq x seq``) is
built once per device and handed to SDPA, whose math kernel then holds the scores. A transformers model among the
trainer's models is also given ``position_ids`` (its rotary positions then restart with each
document) when its call does not pass them; a model of your own reads the stream's
``position_ids`` itself.

Under context parallelism the ids go to the gathered attention instead, which masks the
whole sequence's keys by document as well as position (``ContextParallel.documents``).

Like context parallelism, the context replaces the module attribute rather than installing
a torch-function mode: activation checkpointing recomputes attention inside backward, where
the modes of the forward are gone.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from dream_trainer.parallel.context_hf import hf_class_name, is_hf_model


class DocumentAttention:
    """SDPA restricted to the documents of ``document_ids`` (``[batch, seq]``, equal ids
    for the tokens of one document, which are contiguous).

    Args:
        document_ids: Each token's document.
        inner: The SDPA this one calls with the document mask (the one in place when the
            context was entered).
    """

    def __init__(self, document_ids: torch.Tensor, inner: Any) -> None:
        if document_ids.dim() != 2:
            raise ValueError(f"document_ids of shape {tuple(document_ids.shape)}: give one "
                             "row of document ids per sequence, [batch, seq]")
        self.document_ids = document_ids
        self.inner = inner
        self._masks: dict[tuple[bool, torch.device], Any] = {}
        self._block_masks: dict[bool, Any] = {}

    def use(self, document_ids: torch.Tensor) -> None:
        """Mask by ``document_ids`` from now on (a pipeline's next microbatch)."""
        if document_ids is not self.document_ids:
            self.document_ids = document_ids
            self._masks, self._block_masks = {}, {}

    def attend(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               attn_mask: torch.Tensor | None = None, dropout_p: float = 0.0,
               is_causal: bool = False, scale: float | None = None,
               enable_gqa: bool = False) -> torch.Tensor:
        """``F.scaled_dot_product_attention`` within each document (see the module docstring);
        a mask the caller gives (a padding mask, or the one transformers builds from
        restarting positions) is combined with the documents'."""
        batch, length = self.document_ids.shape
        if query.size(-2) != length or key.size(-2) != length:
            raise ValueError(
                f"attention over {query.size(-2)} queries and {key.size(-2)} keys inside the "
                f"documents context, whose sequences are {length} tokens: the context "
                "restricts self-attention over the packed sequence; run other attention "
                "(cross-attention, a decoding step with a cache) outside it")
        if query.size(0) != batch:
            raise ValueError(
                f"attention over a batch of {query.size(0)} sequences inside the documents "
                f"context of {batch}: give the context the document ids of the batch the "
                "model runs")
        if query.device.type == "cuda" and attn_mask is None and dropout_p == 0.0:
            return flex_documents(query, key, value, self._block_mask(bool(is_causal), query),
                                  scale, enable_gqa)
        mask = self._mask(bool(is_causal), query.device)
        if attn_mask is not None:
            mask = mask & attn_mask if attn_mask.dtype == torch.bool \
                else torch.where(mask, attn_mask, float("-inf"))
        return self.inner(query, key, value, attn_mask=mask, dropout_p=dropout_p,
                          is_causal=False, scale=scale, enable_gqa=enable_gqa)

    def _block_mask(self, causal: bool, query: torch.Tensor) -> Any:
        """FlexAttention's block mask of the documents (cached like the boolean one)."""
        if causal not in self._block_masks:
            self._block_masks[causal] = document_block_mask(
                self.document_ids.to(query.device), causal)
        return self._block_masks[causal]

    def _mask(self, causal: bool, device: torch.device) -> torch.Tensor:
        """``[batch, 1, seq, seq]``: query i sees key j of its own document (and j <= i)."""
        cached = self._masks.get((causal, device))
        if cached is None:
            ids = self.document_ids.to(device)
            cached = ids[:, None, :, None] == ids[:, None, None, :]
            if causal:
                length = ids.size(1)
                cached = cached & torch.ones(length, length, dtype=torch.bool,
                                             device=device).tril()
            self._masks[(causal, device)] = cached
        return cached


def document_block_mask(document_ids: torch.Tensor, causal: bool) -> Any:
    """FlexAttention's ``BlockMask`` of ``document_ids`` (``[batch, seq]``): a query sees the
    keys of its own document (up to itself when ``causal``); blocks between documents are
    skipped, and no ``seq x seq`` mask is held."""
    from torch.nn.attention.flex_attention import create_block_mask

    def same_document(batch: Any, head: Any, query: Any, key: Any) -> Any:
        same = document_ids[batch, query] == document_ids[batch, key]
        return same & (key <= query) if causal else same

    batch, length = document_ids.shape
    return create_block_mask(same_document, batch, None, length, length,
                             device=document_ids.device)


def flex_documents(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                   block_mask: Any, scale: float | None, enable_gqa: bool) -> torch.Tensor:
    """Attention under ``block_mask`` by FlexAttention: compiled on CUDA (its fused kernel,
    forward and backward); eager elsewhere, forward only (torch has no CPU backward)."""
    from torch.nn.attention.flex_attention import flex_attention

    global _COMPILED_FLEX
    run = flex_attention
    if query.device.type == "cuda":
        if _COMPILED_FLEX is None:
            _COMPILED_FLEX = torch.compile(flex_attention, dynamic=False)
        run = _COMPILED_FLEX
    return run(query, key, value, block_mask=block_mask, scale=scale, enable_gqa=enable_gqa)


_COMPILED_FLEX: Any = None


@contextlib.contextmanager
def documents(document_ids: torch.Tensor, position_ids: torch.Tensor | None = None,
              models: Iterable[nn.Module] = ()) -> Iterator[None]:
    """Attention within documents until the context exits (see the module docstring).

    Args:
        document_ids: ``[batch, seq]``, each token's document.
        position_ids: ``[batch, seq]``, each token's position in its document, given to the
            transformers models among ``models`` that are called without positions.
        models: The trainer's models.

    Raises:
        ValueError: if the shapes differ, or (when a transformers model is called) it is
            given an ``attention_mask``, which the documents' mask replaces.
    """
    if position_ids is not None and position_ids.shape != document_ids.shape:
        raise ValueError(f"position_ids of shape {tuple(position_ids.shape)} and document_ids "
                         f"of shape {tuple(document_ids.shape)}: give both per token")
    attention = DocumentAttention(document_ids, F.scaled_dot_product_attention)
    hooks = [model.register_forward_pre_hook(_positions_hook(position_ids), with_kwargs=True)
             for model in _hf_models(models)]
    F.scaled_dot_product_attention = attention.attend  # type: ignore[assignment]
    try:
        yield
    finally:
        F.scaled_dot_product_attention = attention.inner
        for hook in hooks:
            hook.remove()


@contextlib.contextmanager
def microbatch_documents(chunks: list[torch.Tensor]) -> Iterator[Callable[[int], None]]:
    """Attention within documents for a pipeline schedule whose microbatch ``i`` holds the
    rows of ``chunks[i]``: yields the function the schedule calls with the index of the
    microbatch it runs (forward, or backward when activations are recomputed) next.

    A transformers model's stages keep the sequence's rotary positions: rotary attention
    depends on the distance between a query and a key only, which the documents' mask keeps
    inside one document, so its result is the documents' own.
    """
    attention = DocumentAttention(chunks[0], F.scaled_dot_product_attention)
    F.scaled_dot_product_attention = attention.attend  # type: ignore[assignment]
    try:
        yield lambda index: attention.use(chunks[index])
    finally:
        F.scaled_dot_product_attention = attention.inner


def _hf_models(models: Iterable[nn.Module]) -> list[nn.Module]:
    """The outermost transformers models inside ``models``."""
    found: list[nn.Module] = []
    for model in models:
        for module in model.modules():
            if is_hf_model(module) and not any(module in outer.modules() for outer in found):
                found.append(module)
    return found


def _positions_hook(position_ids: torch.Tensor | None) -> Any:
    def hook(module: nn.Module, args: tuple[Any, ...],
             kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        if kwargs.get("attention_mask") is not None:
            raise ValueError(
                f"{hf_class_name(module)} was given an attention_mask inside the documents "
                "context: the documents' mask is the attention mask there (a packed sample "
                "has no padding); call the model without attention_mask")
        if position_ids is not None and kwargs.get("position_ids") is None:
            kwargs = {**kwargs, "position_ids": position_ids}
        return args, kwargs

    return hook
