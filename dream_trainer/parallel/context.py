"""Context parallelism: each sequence split over the ``cp`` ranks, attention over all of it.

Every tensor input and target is cut along the sequence dimension into ``2 x cp`` chunks
(``cp`` without load balancing); rank r keeps chunks r and ``2cp-1-r``, a head and a tail,
so that under causal attention each rank has the same work. Everything but attention is
per token and runs on the local part unchanged. Attention all-gathers the keys and values
of the whole sequence over ``cp`` (in backward their gradients are summed back to their
owners), and each local chunk of queries attends to the keys up to its global position
(without a mask tensor; ``context_attention``), so a rank's queries see exactly the keys one
process would show them. Under a sliding window each chunk attends to the band of keys its
window reaches; transformers models get their windows and positions through ``context_hf``.

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
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from dream_trainer.parallel.context_attention import GatheredAttention, attention_through
from dream_trainer.parallel.context_hf import HFDecoders, check_attention
from dream_trainer.parallel.context_split import SequenceSplit, split_problem
from dream_trainer.parallel.documents import documents
from dream_trainer.world.dims import MeshAxis
from dream_trainer.world.world import DistributedWorld

Tensors = tuple[Any, ...]


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

    def documents(self, document_ids: torch.Tensor, position_ids: torch.Tensor | None,
                  models: Iterable[nn.Module]) -> contextlib.AbstractContextManager[None]:
        """Attention within packed documents (``parallel.documents``): here every SDPA call
        masked by the documents of the whole sequences."""
        return documents(document_ids, position_ids, models)

    def whole_loss(self, loss: torch.Tensor, summed: bool) -> torch.Tensor:
        """The loss of the whole sequences from this rank's part of it: here the loss."""
        return loss

    def sequence_sum(self, values: torch.Tensor) -> torch.Tensor:
        """Per-sequence sums of this rank's tokens as sums over the whole sequences: here
        as they are (``StepAPI.sequence_sum``)."""
        return values


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
        self._documents: tuple[torch.Tensor, torch.Tensor | None] | None = None
        """The whole sequences' document and position ids inside ``documents``."""

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
        self._decoders = HFDecoders(models, self.ranks, lambda: self._active, self._group,
                                    self._document_positions)

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
            attention = GatheredAttention(split, group, self.ranks, self._rank(),
                                          self._document_ids)
            decoders = self._decoders.attention(attention) if self._decoders is not None \
                else contextlib.nullcontext()
            with _local_buffers(self.buffers, split), attention_through(attention), decoders:
                yield parts
        finally:
            self._active = None

    @contextlib.contextmanager
    def documents(self, document_ids: torch.Tensor, position_ids: torch.Tensor | None,
                  models: Iterable[nn.Module]) -> Iterator[None]:
        """Packed documents under the split: the gathered attention masks keys by document
        as well as position, and transformers' rotary positions are the documents' (from
        ``position_ids`` at the positions this rank holds). ``document_ids`` and
        ``position_ids`` are the whole sequences' (``[batch, seq]``, not split); a model of
        your own takes its part of ``position_ids`` through the split like any input.

        Raises:
            ValueError: if the shapes differ.
        """
        if document_ids.dim() != 2 or (position_ids is not None
                                       and position_ids.shape != document_ids.shape):
            raise ValueError(
                f"document_ids of shape {tuple(document_ids.shape)} and position_ids of shape "
                f"{None if position_ids is None else tuple(position_ids.shape)}: give both "
                "per token of the whole sequences, [batch, seq]")
        previous, self._documents = self._documents, (document_ids, position_ids)
        try:
            yield
        finally:
            self._documents = previous

    def whole_loss(self, loss: torch.Tensor, summed: bool) -> torch.Tensor:
        """The sum of the ranks' losses (``summed``: sums over items), else their mean
        (means over equal parts)."""
        total = loss.detach().clone()
        dist.all_reduce(total, group=self._group())
        return total if summed else total / self.ranks

    def sequence_sum(self, values: torch.Tensor) -> torch.Tensor:
        """The sum of ``values`` over the ``cp`` ranks, differentiable: a loss computed
        from it is the whole sequences' loss on every rank, and each rank's backward gives
        its own tokens' share of the gradient, scaled so that the gradient averaging over
        the ``cp`` ranks (as for the parts of a mean loss) leaves the whole gradient."""
        return _CrossRankSum.apply(values, self._group(), self.ranks)

    def _document_ids(self) -> torch.Tensor | None:
        return None if self._documents is None else self._documents[0]

    def _document_positions(self) -> torch.Tensor | None:
        return None if self._documents is None else self._documents[1]

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


class _CrossRankSum(torch.autograd.Function):
    """Forward: the all-reduced sum over ``group``. Backward: the incoming gradient times
    the group's size (every rank computes the same loss from the sum; the ranks' gradients
    are then averaged, as those of a mean loss's equal parts are)."""

    @staticmethod
    def forward(ctx: Any, values: torch.Tensor, group: dist.ProcessGroup,
                ranks: int) -> torch.Tensor:
        ctx.ranks = ranks
        total = values.detach().clone()
        dist.all_reduce(total, group=group)
        return total

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return grad * ctx.ranks, None, None
