"""Context parallelism: each sequence split over the ``cp`` ranks, attention over all of it.

Every tensor input and target is cut along the sequence dimension into ``2 x cp`` chunks
(``cp`` without load balancing); rank r keeps chunks r and ``2cp-1-r``, a head and a tail,
so that under causal attention each rank has the same work. Everything but attention is
per token and runs on the local part unchanged. Attention all-gathers the keys and values
of the whole sequence over ``cp`` (in backward their gradients are summed back to their
owners), and each local chunk of queries attends to the keys up to its global position
(without a mask tensor: see ``_CausalChunks``), so a rank's queries see exactly the keys one
process would show them. Under a sliding window each chunk attends to the band of keys its
window reaches (``window_chunks``); transformers models get their windows and positions
through ``context_hf``.

Why an all-gather rather than a ring: it is Llama 3's design for long-context training, it
runs any SDPA kernel unchanged (the CPU kernels included, which torch's ring implementation
does not dispatch), its result is the one-process attention with no merging of partial
softmaxes, and one collective per layer overlaps poorly only at very long sequences, where
a ring would win. The cost is memory: each rank keeps every layer's gathered keys and values
(the whole sequence's) for backward, next to its own share of everything else (recomputed
instead under activation checkpointing).
"""

from __future__ import annotations

import contextlib
import fnmatch
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from dream_trainer.parallel.context_hf import HFDecoders, check_attention
from dream_trainer.world.dims import MeshAxis
from dream_trainer.world.world import DistributedWorld

Tensors = tuple[Any, ...]

_SDPA = F.scaled_dot_product_attention
"""torch's own, whatever ``split`` puts in its place."""
_FLASH = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_FLASH_BACKWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


def sequence_positions(length: int, cp: int, rank: int, balanced: bool) -> torch.Tensor:
    """The positions of a ``length``-long sequence that context-parallel rank ``rank`` of
    ``cp`` holds, in the order it holds them: chunks ``rank`` and ``2cp-1-rank`` of ``2cp``
    when ``balanced``, else chunk ``rank`` of ``cp``."""
    size = length // (2 * cp if balanced else cp)
    return torch.cat([torch.arange(chunk * size, (chunk + 1) * size)
                      for chunk in held_chunks(cp, rank, balanced)])


def held_chunks(cp: int, rank: int, balanced: bool) -> tuple[int, ...]:
    """The chunks context-parallel rank ``rank`` of ``cp`` holds, in its order: ``rank`` and
    ``2cp-1-rank`` of ``2cp`` when ``balanced``, else ``rank`` of ``cp``."""
    return (rank, 2 * cp - 1 - rank) if balanced else (rank,)


def split_problem(length: int, cp: int, balanced: bool) -> str | None:
    """Why a sequence of ``length`` cannot be split over ``cp`` ranks, or None."""
    chunks = 2 * cp if balanced else cp
    if length % chunks == 0:
        return None
    how = (f"2 x context_parallel = {chunks} chunks (a head and a tail per rank, "
           "context_parallel_load_balance=True)" if balanced
           else f"context_parallel = {chunks} chunks")
    return (f"a sequence of {length} positions does not split into {how}: pad or cut the "
            f"sequences to a multiple of {chunks}, or change context_parallel")


class SequenceSplit:
    """This rank's part of sequences of one length: which positions it holds, in chunks, and
    how to put the keys gathered from every rank (in rank order) back in position order."""

    def __init__(self, length: int, cp: int, rank: int, balanced: bool,
                 device: torch.device) -> None:
        self.length = length
        self.local = sequence_positions(length, cp, rank, balanced).to(device)
        gathered = torch.cat([sequence_positions(length, cp, peer, balanced)
                              for peer in range(cp)]).to(device)
        self.natural_order = torch.argsort(gathered)
        """Where each position's key is among the gathered ones (rank order)."""
        chunks = 2 * cp if balanced else cp
        self.chunk = length // chunks
        # From the chunk numbers, not read back from ``local``: a plan's tensors have no values.
        self.starts = [chunk * self.chunk for chunk in held_chunks(cp, rank, balanced)]
        """The first position of each chunk this rank holds, in its order."""
        self._bands: dict[int, list[tuple[int, torch.Tensor]]] = {}

    def bands(self, window: int) -> list[tuple[int, torch.Tensor]]:
        """For each chunk this rank holds, the first key position it can see under a sliding
        window of ``window`` keys (a query at ``p`` sees keys ``p - window < k <= p``, as
        transformers' masks) and the boolean mask of its queries over the keys from there to
        the chunk's end: ``[chunk, end - first]``, at most ``chunk + window - 1`` wide."""
        if window not in self._bands:
            device = self.local.device
            rows = torch.arange(self.chunk, device=device).unsqueeze(1)
            bands = []
            for start in self.starts:
                first = max(0, start - window + 1)
                keys = torch.arange(first, start + self.chunk, device=device).unsqueeze(0)
                queries = rows + start
                bands.append((first, (keys <= queries) & (keys > queries - window)))
            self._bands[window] = bands
        return self._bands[window]

    def take(self, tensor: torch.Tensor, dim: int) -> torch.Tensor:
        """``tensor``'s rows at this rank's positions along ``dim``."""
        return tensor.index_select(dim, self.local)


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


class _GatheredAttention:
    """``attend`` stands for ``F.scaled_dot_product_attention`` while a split is active: over
    this rank's part of a split sequence it attends to the whole sequence
    (``SequenceSplit``)."""

    def __init__(self, split: SequenceSplit, group: dist.ProcessGroup, ranks: int,
                 rank: int) -> None:
        self.split, self.group, self.ranks, self.rank = split, group, ranks, rank
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
        if not is_causal:
            return _SDPA(query, key, value, dropout_p=dropout_p, scale=scale,
                         enable_gqa=enable_gqa)
        order = self.split.natural_order
        key, value = key.index_select(dim, order), value.index_select(dim, order)
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


class Context:
    """Without context parallelism every rank holds whole sequences: nothing to split.

    A part of every layout (``Layout.context``), since context parallelism composes with
    the other degrees; ``ContextParallel`` is the one that acts.
    """

    def bind(self, buffers: Mapping[str, int], models: Mapping[str, nn.Module]) -> None:
        """Find what carries positions in the built models: the buffers
        ``context_parallel_buffers()`` names, and ``transformers``' rotary embeddings
        (nothing to find here)."""

    def split(self, tensors: Tensors,
              seq_dim: int | None = None) -> contextlib.AbstractContextManager[Tensors]:
        """A context yielding ``tensors`` as this rank runs them: here as they are."""
        return contextlib.nullcontext(tensors)

    def whole_loss(self, loss: torch.Tensor, summed: bool) -> torch.Tensor:
        """The loss of the whole sequences from this rank's part of it: here the loss."""
        return loss


class ContextParallel(Context):
    """``context_parallel > 1``: sequences split over the ``cp`` ranks (see the module
    docstring), attention gathering keys and values, position buffers cut to match.

    Args:
        world: The run's topology; the ``cp`` mesh is read when first needed.
        seq_dim: ``context_parallel_seq_dim``, the default sequence dimension of a split.
        balanced: ``context_parallel_load_balance``.
    """

    def __init__(self, world: DistributedWorld, seq_dim: int, balanced: bool) -> None:
        self.world = world
        self.seq_dim = seq_dim
        self.balanced = balanced
        self.ranks = world.dims.cp
        self.buffers: list[tuple[nn.Module, str, int]] = []
        self._splits: dict[tuple[int, torch.device], SequenceSplit] = {}
        self._active: SequenceSplit | None = None
        self._decoders: HFDecoders | None = None

    def bind(self, buffers: Mapping[str, int], models: Mapping[str, nn.Module]) -> None:
        """Find each buffer named ``"<model attribute>.<module path>.<buffer>"`` (a rotary
        table indexed by position, say; the module path may hold ``*`` wildcards, as in
        ``"model.layers.*.rope.angles"``) with its sequence dimension: inside ``split`` it
        holds only this rank's positions, in this rank's order. transformers models among
        ``models`` get what they need without user code (``context_hf``).

        Raises:
            ValueError: naming a buffer that no model holds, or a transformers model whose
                attention does not run through SDPA.
        """
        check_attention(models, self.ranks)
        self.buffers = []
        for path, dim in buffers.items():
            found = _find_buffers(path, models)
            if not found:
                raise ValueError(
                    f"context_parallel_buffers() names {path!r}, but no model holds such a "
                    "buffer: give '<model attribute>.<module path>.<buffer name>' as "
                    f"named_buffers() spells it (models: {sorted(models)})")
            self.buffers += [(module, name, dim) for module, name in found]
        if self._decoders is not None:
            self._decoders.remove()
        self._decoders = HFDecoders(models, self.ranks, lambda: self._active, self._group)

    @contextlib.contextmanager
    def split(self, tensors: Tensors, seq_dim: int | None = None) -> Iterator[Tensors]:
        """Yield each tensor of ``tensors`` cut to this rank's positions along ``seq_dim``
        (``context_parallel_seq_dim`` by default; other values pass through), with attention
        over the whole sequence and the position buffers cut to match until the context
        exits. Backward must run inside it when activations are recomputed.

        Raises:
            ValueError: if the tensors' sequence lengths differ or do not split into the
                chunks (naming the fields), or a position buffer is shorter than them.
        """
        dim = self.seq_dim if seq_dim is None else seq_dim
        lengths = {t.size(dim) for t in tensors if isinstance(t, torch.Tensor) and t.dim() > dim}
        if len(lengths) != 1:
            raise ValueError(
                f"context_parallel={self.ranks} splits every tensor input and target along "
                f"context_parallel_seq_dim={dim}, but their lengths there are "
                f"{sorted(lengths) or 'absent'}: give tensors of one sequence length (or set "
                "context_parallel_seq_dim)")
        length = lengths.pop()
        problem = split_problem(length, self.ranks, self.balanced)
        if problem is not None:
            raise ValueError(problem)
        split = self._split(length)
        group = self._group()
        parts = tuple(split.take(t, dim) if isinstance(t, torch.Tensor) and t.dim() > dim
                      else t for t in tensors)
        self._active = split
        try:
            attention = _GatheredAttention(split, group, self.ranks, self._rank())
            decoders = self._decoders.attention(attention) if self._decoders is not None \
                else contextlib.nullcontext()
            with _local_buffers(self.buffers, split), _attention_through(attention), decoders:
                yield parts
        finally:
            self._active = None

    def whole_loss(self, loss: torch.Tensor, summed: bool) -> torch.Tensor:
        """The sum of the ranks' losses (``summed``: sums over items), else their mean
        (means over equal parts)."""
        total = loss.detach().clone()
        dist.all_reduce(total, group=self._group())
        return total if summed else total / self.ranks

    def _split(self, length: int) -> SequenceSplit:
        key = (length, self.world.device)
        if key not in self._splits:
            self._splits[key] = SequenceSplit(length, self.ranks, self._rank(), self.balanced,
                                              self.world.device)
        return self._splits[key]

    def _group(self) -> dist.ProcessGroup:
        group = self.world.get_group(MeshAxis.CP)
        if group is None:
            raise RuntimeError("the cp mesh axis does not exist: the run is not launched")
        return group

    def _rank(self) -> int:
        mesh = self.world.get_mesh(MeshAxis.CP)
        assert mesh is not None
        return mesh.get_local_rank()


def _find_buffers(path: str, models: Mapping[str, nn.Module]) -> list[tuple[nn.Module, str]]:
    """Every (module, buffer name) matching ``path``, looking through compilation's
    ``_orig_mod`` and a pipeline's stages (each stage holding a copy counts)."""
    model_name, _, rest = path.partition(".")
    model = models.get(model_name)
    if model is None or not rest:
        return []
    module_path, _, buffer = rest.rpartition(".")
    found = []
    for name, module in model.named_modules():
        plain = ".".join(part for part in name.split(".") if part != "_orig_mod")
        if fnmatch.fnmatchcase(plain, module_path) and buffer in module._buffers \
                and module._buffers[buffer] is not None:
            found.append((module, buffer))
    return found


@contextlib.contextmanager
def _attention_through(attention: _GatheredAttention) -> Iterator[None]:
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


@contextlib.contextmanager
def _local_buffers(buffers: Sequence[tuple[nn.Module, str, int]],
                   split: SequenceSplit) -> Iterator[None]:
    saved: list[tuple[nn.Module, str, torch.Tensor]] = []
    try:
        for module, name, dim in buffers:
            whole = module._buffers[name]
            assert whole is not None
            if whole.size(dim) < split.length:
                raise ValueError(
                    f"the position buffer {name!r} has {whole.size(dim)} positions along dim "
                    f"{dim}, fewer than the sequence's {split.length}")
            saved.append((module, name, whole))
            module._buffers[name] = split.take(whole, dim)
        yield
    finally:
        for module, name, whole in reversed(saved):
            module._buffers[name] = whole
