"""Attention over the whole sequence from a context-parallel rank's part of it: keys and
values all-gathered over ``cp``, each local chunk of queries attending to the keys up to its
global position (``parallel.context`` explains the split and why an all-gather)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from dream_trainer.parallel.context_split import SequenceSplit

_SDPA = F.scaled_dot_product_attention
"""torch's own, whatever ``attention_through`` puts in its place."""
_FLASH = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_FLASH_BACKWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


class _GatherSequence(torch.autograd.Function):
    """All-gather along a dimension in rank order; backward sums every rank's gradient of
    the whole and hands each rank the part it contributed."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, dim: int, group: dist.ProcessGroup,
                ranks: int, rank: int) -> torch.Tensor:
        ctx.dim, ctx.group, ctx.ranks, ctx.rank = dim, group, ranks, rank
        parts = [torch.empty_like(tensor) for _ in range(ranks)]
        dist.all_gather(parts, tensor.contiguous(), group=group)
        return torch.cat(parts, dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        grad = grad.contiguous()
        if dist.get_backend(ctx.group) == "gloo":  # gloo has no reduce-scatter of tensors
            dist.all_reduce(grad, group=ctx.group)
            mine = grad.chunk(ctx.ranks, ctx.dim)[ctx.rank].contiguous()
        else:
            parts = [part.contiguous() for part in grad.chunk(ctx.ranks, ctx.dim)]
            mine = torch.empty_like(parts[ctx.rank])
            dist.reduce_scatter(mine, parts, group=ctx.group)
        return mine, None, None, None, None


class _CausalChunks(torch.autograd.Function):
    """Causal attention of a rank's chunks of queries over the whole sequence's keys (in
    position order), without a mask: each chunk attends to the keys before it in full and to
    its own block causally, two calls of the CPU flash kernel merged by their log-sum-exp.
    Backward runs the kernel's backward on each block with the merged output and
    log-sum-exp, which gives each block's exact share of the gradients.

    A mask would cost a ``[local, length]`` tensor per layer that the CPU kernels turn into
    floats and keep for backward: more memory than the split saves on long sequences.
    """

    @staticmethod
    def forward(ctx: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                starts: list[int], chunk: int, scale: float | None) -> torch.Tensor:
        outputs, sums = [], []
        for index, start in enumerate(starts):
            q = query[..., index * chunk:(index + 1) * chunk, :]
            out, lse = _FLASH(q, key[..., start:start + chunk, :],
                              value[..., start:start + chunk, :], 0.0, True, scale=scale)
            if start > 0:
                past, past_lse = _FLASH(q, key[..., :start, :], value[..., :start, :], 0.0,
                                        False, scale=scale)
                merged = torch.logaddexp(lse, past_lse)
                out = (out.float() * (lse - merged).exp().unsqueeze(-1)
                       + past.float() * (past_lse - merged).exp().unsqueeze(-1)).to(q.dtype)
                lse = merged
            outputs.append(out)
            sums.append(lse)
        output, lse = torch.cat(outputs, -2), torch.cat(sums, -1)
        ctx.save_for_backward(query, key, value, output, lse)
        ctx.starts, ctx.chunk, ctx.scale = starts, chunk, scale
        return output

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        query, key, value, output, lse = ctx.saved_tensors
        chunk, scale = ctx.chunk, ctx.scale
        grad = grad.contiguous()
        d_query, d_key, d_value = (torch.zeros_like(t) for t in (query, key, value))
        for index, start in enumerate(ctx.starts):
            rows = slice(index * chunk, (index + 1) * chunk)
            args = (grad[..., rows, :], query[..., rows, :].contiguous())
            state = (output[..., rows, :].contiguous(), lse[..., rows].contiguous())
            blocks = [(slice(start, start + chunk), True)]
            if start > 0:
                blocks.append((slice(0, start), False))
            for keys, causal in blocks:
                dq, dk, dv = _FLASH_BACKWARD(
                    *args, key[..., keys, :].contiguous(), value[..., keys, :].contiguous(),
                    *state, 0.0, causal, scale=scale)
                d_query[..., rows, :] += dq
                d_key[..., keys, :] += dk
                d_value[..., keys, :] += dv
        return d_query, d_key, d_value, None, None, None


def lower_right_chunks(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                       starts: list[int], chunk: int, dropout_p: float = 0.0,
                       scale: float | None = None, enable_gqa: bool = False) -> torch.Tensor:
    """``_CausalChunks`` through torch's public SDPA, for CUDA (and dropout): each chunk
    of queries attends to the keys up to its end with a lower-right causal bias, which
    CUDA's flash and memory-efficient kernels take without a mask tensor (the CPU's
    math kernel would build one)."""
    from torch.nn.attention.bias import causal_lower_right

    parts = []
    for index, start in enumerate(starts):
        end = start + chunk
        parts.append(_SDPA(query[..., index * chunk:(index + 1) * chunk, :],
                           key[..., :end, :], value[..., :end, :],
                           attn_mask=causal_lower_right(chunk, end), dropout_p=dropout_p,
                           scale=scale, enable_gqa=enable_gqa))
    return torch.cat(parts, -2)


def window_chunks(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  split: SequenceSplit, window: int, dropout_p: float = 0.0,
                  scale: float | None = None, enable_gqa: bool = False) -> torch.Tensor:
    """Sliding-window causal attention of a rank's chunks of queries over the whole
    sequence's keys (in position order), by global position: each chunk attends through its
    band's mask (``SequenceSplit.bands``) to the keys its window reaches, so the cost per
    chunk is its band, not the sequence; autograd differentiates torch's kernel."""
    parts = []
    for index, (first, mask) in enumerate(split.bands(window)):
        end = split.starts[index] + split.chunk
        parts.append(_SDPA(query[..., index * split.chunk:(index + 1) * split.chunk, :],
                           key[..., first:end, :], value[..., first:end, :], attn_mask=mask,
                           dropout_p=dropout_p, scale=scale, enable_gqa=enable_gqa))
    return torch.cat(parts, -2)


class GatheredAttention:
    """``attend`` stands for ``F.scaled_dot_product_attention`` while a split is active: over
    this rank's part of a split sequence it attends to the whole sequence
    (``SequenceSplit``)."""

    def __init__(self, split: SequenceSplit, group: dist.ProcessGroup, ranks: int,
                 rank: int, documents: Callable[[], torch.Tensor | None] = lambda: None
                 ) -> None:
        self.split, self.group, self.ranks, self.rank = split, group, ranks, rank
        self.documents = documents
        """The whole sequences' document ids while packed documents run, else None."""
        self._inside = False
        """True while torch's causal bias, called from here, calls SDPA back by its name."""
        self.window: int | None = None
        """The sliding window of the attention now running (set around a transformers
        layer's attention that declares one, ``context_hf``), else None."""

    def attend(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               attn_mask: torch.Tensor | None = None, dropout_p: float = 0.0,
               is_causal: bool = False, scale: float | None = None,
               enable_gqa: bool = False) -> torch.Tensor:
        if self._inside:
            return _SDPA(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p,
                         is_causal=is_causal, scale=scale, enable_gqa=enable_gqa)
        local = self.split.local.numel()
        if query.size(-2) != local or key.size(-2) != local:
            # Cross-attention to a context that was not split (a text encoding, say) is
            # exact on the local queries as it is.
            if query.size(-2) == local and not is_causal:
                return _SDPA(
                    query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, scale=scale,
                    enable_gqa=enable_gqa)
            raise ValueError(
                f"under context_parallel={self.ranks} attention received queries of length "
                f"{query.size(-2)} and keys of length {key.size(-2)}, but this rank holds "
                f"{local} positions of the split sequence: attention must run on the split "
                "sequence (dim -2 of [batch, heads, sequence, head_dim]); check "
                "context_parallel_seq_dim")
        if attn_mask is not None:
            raise ValueError(
                f"under context_parallel={self.ranks} attention received an attn_mask of shape "
                f"{tuple(attn_mask.shape)}, but a mask built over this rank's "
                f"{local} positions does not describe the whole sequence's {self.split.length}: "
                "pass is_causal=True for causal attention (nothing for full attention) and no "
                "mask; a sliding window is applied by position for transformers models that "
                "declare one")
        dim = query.dim() - 2
        key = _GatherSequence.apply(key, dim, self.group, self.ranks, self.rank)
        value = _GatherSequence.apply(value, dim, self.group, self.ranks, self.rank)
        if not is_causal and self.documents() is None:
            return _SDPA(query, key, value, dropout_p=dropout_p, scale=scale,
                         enable_gqa=enable_gqa)
        order = self.split.natural_order
        key, value = key.index_select(dim, order), value.index_select(dim, order)
        document_ids = self.documents()
        if document_ids is not None:
            return _SDPA(query, key, value,
                         attn_mask=self._document_mask(document_ids, is_causal),
                         dropout_p=dropout_p, scale=scale, enable_gqa=enable_gqa)
        if self.window is not None and self.window < self.split.length:
            return window_chunks(query, key, value, self.split, self.window, dropout_p, scale,
                                 enable_gqa)
        if query.device.type == "cpu" and dropout_p == 0:
            if enable_gqa and key.size(-3) != query.size(-3):
                repeats = query.size(-3) // key.size(-3)
                key = key.repeat_interleave(repeats, -3)
                value = value.repeat_interleave(repeats, -3)
            return _CausalChunks.apply(query, key, value, self.split.starts, self.split.chunk,
                                       scale)
        self._inside = True
        try:
            return lower_right_chunks(query, key, value, self.split.starts, self.split.chunk,
                                      dropout_p, scale, enable_gqa)
        finally:
            self._inside = False

    def _document_mask(self, document_ids: torch.Tensor, causal: bool) -> torch.Tensor:
        """``[batch, 1, local, length]``: this rank's queries see the keys of their own
        document (up to their position when causal, inside the window when one is set), in
        position order. A mask, so the kernel computes every score: the documents' price."""
        split = self.split
        if document_ids.dim() != 2 or document_ids.size(1) != split.length:
            raise ValueError(
                f"under context_parallel={self.ranks} the documents' ids must be the whole "
                f"sequences' ([batch, {split.length}]), but they have shape "
                f"{tuple(document_ids.shape)}: give self.documents the batch's document_ids "
                "before the split, not this rank's part")
        ids = document_ids.to(split.local.device)
        queries = split.local.unsqueeze(1)
        keys = torch.arange(split.length, device=queries.device).unsqueeze(0)
        mask = ids[:, None, split.local, None] == ids[:, None, None, :]
        if causal:
            mask = mask & (keys <= queries)
        if self.window is not None:
            mask = mask & (keys > queries - self.window)
        return mask


@contextlib.contextmanager
def attention_through(attention: GatheredAttention) -> Iterator[None]:
    """``F.scaled_dot_product_attention`` is ``attention.attend`` until the context exits.

    A module attribute rather than a torch-function mode: activation checkpointing
    recomputes attention inside backward, where autograd runs without the modes of the
    forward, and a mode would add a Python call to every other operation of the step.
    """
    F.scaled_dot_product_attention = attention.attend  # type: ignore[assignment]
    try:
        yield
    finally:
        F.scaled_dot_product_attention = _SDPA
