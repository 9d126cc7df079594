"""``MoE``: a dropless mixture-of-experts feed-forward layer with a token-choice top-k router.

Each token's router scores (softmax or sigmoid of a linear map) pick its ``top_k`` experts;
every picked expert runs on the token (no capacity limit, no dropped token) and the outputs are
added with the token's scores as weights. The experts are SwiGLU feed-forward networks whose
weights are stored stacked, ``[num_experts, ...]``, so that they shard along the expert
dimension. Two ways to balance the load, usable together:

- the auxiliary loss ``aux_loss`` (DeepSeek's form, ``aux_loss_weight * sum_i f_i * P_i``,
  with ``f_i`` the share of the routing slots expert ``i`` received, scaled so that a uniform
  load gives 1, and ``P_i`` its mean routing probability over the call's tokens), computed at
  each call for the caller to add to its loss; ``f_i`` counts the call's slots
  (``aux_loss_scope="micro_batch"``) or those of the whole previous optimizer step, every
  micro-batch on every rank that holds different tokens (``"global_batch"``);
- DeepSeek-V3's auxiliary-loss-free balancing: a per-expert bias added to the scores for the
  choice of experts only (never to the weights), moved after each optimizer step by
  ``bias_update_rate`` towards the under-loaded experts, from the token counts of the whole
  step (``update_bias``; the trainer's ``step()`` calls it with the counts of every micro-batch
  and of every rank that holds different tokens, data- and context-parallel, so every rank
  moves its bias as one process would).
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Iterator
from contextvars import ContextVar
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import nn

ScoreFunc = Literal["softmax", "sigmoid"]
AuxLossScope = Literal["micro_batch", "global_batch"]

_BALANCED = ContextVar("dream_trainer_balanced_routing", default=False)
_UNCOUNTED = ContextVar("dream_trainer_uncounted_load", default=False)


@contextlib.contextmanager
def balanced_routing() -> Iterator[None]:
    """Within the block, every ``MoE`` layer gives each expert an equal share of its routing
    slots (the first experts one more when they do not divide) instead of reading the
    router's choices: the sizes of every tensor and message are then known without values.
    For ``dream-trainer plan``, which runs a step on tensors that have shapes only; the
    router still runs, so its cost is counted."""
    token = _BALANCED.set(True)
    try:
        yield
    finally:
        _BALANCED.reset(token)


@contextlib.contextmanager
def uncounted_load() -> Iterator[None]:
    """Within the block, ``MoE`` layers route as usual but add nothing to the load counts
    that move the balancing bias: for a pass that is not part of the training batch (the
    shape inference a pipeline schedule runs before its first microbatch)."""
    token = _UNCOUNTED.set(True)
    try:
        yield
    finally:
        _UNCOUNTED.reset(token)


def _balanced(slots: int, experts: int) -> list[int]:
    share, extra = divmod(slots, experts)
    return [share + (expert < extra) for expert in range(experts)]


class GroupedExperts(nn.Module):
    """``num_experts`` SwiGLU networks with stacked weights: ``w1``/``w3`` are
    ``[num_experts, dim, hidden_dim]``, ``w2`` is ``[num_experts, hidden_dim, dim]``.

    In bfloat16 and float16 the experts run as three grouped matrix products
    (``torch.nn.functional.grouped_mm``), each expert's rows padded with zero rows to the
    kernel's alignment; in float32 (and on an older torch) one expert after another. Both give
    the same values (``grouped_mm_alignment`` says which runs).

    Args:
        dim: Width of the tokens.
        hidden_dim: Width of each expert's hidden layer.
        num_experts: How many experts.
        use_grouped_mm: False runs the loop whatever the dtype (to compare the two).
    """

    def __init__(self, dim: int, hidden_dim: int, num_experts: int,
                 use_grouped_mm: bool = True) -> None:
        super().__init__()
        self.num_experts, self.use_grouped_mm = num_experts, use_grouped_mm
        self.w1 = nn.Parameter(torch.empty(num_experts, dim, hidden_dim))
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))
        self.w3 = nn.Parameter(torch.empty(num_experts, dim, hidden_dim))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Each expert's matrices drawn as ``nn.Linear`` draws its weight (uniform, bound
        ``1/sqrt(fan_in)``)."""
        for weight in (self.w1, self.w3):
            nn.init.uniform_(weight, -weight.shape[1] ** -0.5, weight.shape[1] ** -0.5)
        nn.init.uniform_(self.w2, -self.w2.shape[1] ** -0.5, self.w2.shape[1] ** -0.5)

    def forward(self, tokens: torch.Tensor, counts: list[int],
                grad_scale: float = 1.0) -> torch.Tensor:
        """Run expert ``e`` on the ``counts[e]`` rows of ``tokens`` after the rows of experts
        ``0..e-1`` (tokens sorted by expert). Under expert parallelism the weights are this
        rank's experts only, and ``counts`` has one entry per local expert.

        Every expert's weights get a gradient, zero for an expert without rows: data-parallel
        ranks reduce the same set of gradients. ``grad_scale`` multiplies the weights'
        gradients (not the output).
        """
        w1, w2, w3 = (_local(weight) for weight in (self.w1, self.w2, self.w3))
        if grad_scale != 1.0:
            w1, w2, w3 = (_ScaleGradient.apply(weight, grad_scale) for weight in (w1, w2, w3))
        quantized = _quantized(self.w1)
        alignment = grouped_mm_alignment(tokens, w1) if self.use_grouped_mm or quantized \
            else None
        if quantized:
            return self._quantized_forward(tokens, counts, w1, w2, w3, alignment)
        if alignment is None:
            # An expert without rows still runs (on no rows), so that it gets a gradient.
            outputs = [(F.silu(chunk @ w1[expert]) * (chunk @ w3[expert])) @ w2[expert]
                       for expert, chunk in enumerate(tokens.split(counts))]
            return torch.cat(outputs)
        rows, offsets, padded_rows = _padded_groups(counts, alignment, tokens.device)
        padded = tokens.new_zeros(padded_rows, tokens.shape[-1]).index_copy(0, rows, tokens)
        # Zero rows stay zero through silu(0) * 0 and add nothing to the weights' gradients.
        hidden = (F.silu(F.grouped_mm(padded, w1, offs=offsets))
                  * F.grouped_mm(padded, w3, offs=offsets))
        return F.grouped_mm(hidden, w2, offs=offsets).index_select(0, rows)

    def _quantized_forward(self, tokens: torch.Tensor, counts: list[int], w1: torch.Tensor,
                           w2: torch.Tensor, w3: torch.Tensor,
                           alignment: int | None) -> torch.Tensor:
        """The grouped products with weights that torchao converted (``parallel.
        float8_experts``): its wrapper quantizes ``torch._grouped_mm``'s operands, wants each
        weight's last two dimensions stored transposed, and each group padded to its scaling
        block (32 rows covers MXFP8's block and float8's 16-byte alignment)."""
        if alignment is None:
            raise TypeError(f"GroupedExperts with low-precision weights runs grouped products "
                            f"only: tokens and weights must be bfloat16 or float16 with widths "
                            f"in multiples of 8, got {tokens.dtype} tokens and "
                            f"{tuple(w1.shape)} weights")
        rows, offsets, padded_rows = _padded_groups(counts, _QUANTIZED_BLOCK, tokens.device)
        padded = tokens.new_zeros(padded_rows, tokens.shape[-1]).index_copy(0, rows, tokens)
        w1, w2, w3 = (weight.transpose(-2, -1).contiguous().transpose(-2, -1)
                      for weight in (w1, w2, w3))
        hidden = (F.silu(torch._grouped_mm(padded, w1, offs=offsets))
                  * torch._grouped_mm(padded, w3, offs=offsets))
        return torch._grouped_mm(hidden, w2, offs=offsets).index_select(0, rows)


_QUANTIZED_BLOCK = 32


def _quantized(weight: torch.Tensor) -> bool:
    """Whether ``weight`` (or its local shard) is torchao's low-precision training wrapper."""
    local = _local(weight.data if isinstance(weight, nn.Parameter) else weight)
    return type(local).__module__.startswith("torchao.prototype.moe_training")


_GROUPED_DTYPES = (torch.bfloat16, torch.float16)


def grouped_mm_alignment(tokens: torch.Tensor, weight: torch.Tensor) -> int | None:
    """The multiple of rows each expert's group is padded to when ``GroupedExperts`` runs
    ``tokens`` (``[rows, dim]``) through ``weight`` (``[experts, dim, hidden_dim]``) as grouped
    matrix products, or None when it runs the experts one after another.

    Grouped for bfloat16 and float16 tokens and weights on the CPU or CUDA, when ``dim`` and
    ``hidden_dim`` are multiples of 16 bytes (torch's kernels refuse other strides). float32
    loops: torch's CPU kernel is a loop of matrix products itself, and on CUDA float32 takes
    torch's fallback, a loop after a host sync; only bfloat16 has the fast CUDA kernel.
    """
    if (tokens.dtype not in _GROUPED_DTYPES or weight.dtype != tokens.dtype
            or tokens.device.type not in ("cpu", "cuda") or not hasattr(F, "grouped_mm")):
        return None
    alignment = 16 // tokens.element_size()  # elements in the 16 bytes the kernels align to
    if tokens.shape[-1] % alignment or weight.shape[-1] % alignment:
        return None
    return alignment


def _padded_groups(counts: list[int], alignment: int,
                   device: torch.device) -> tuple[torch.Tensor, torch.Tensor, int]:
    """``(rows, offsets, padded_rows)``: where each of the ``sum(counts)`` sorted rows goes
    when every expert's group is padded to a multiple of ``alignment`` rows, each group's end
    (``int32``, for ``grouped_mm``'s ``offs``), and the padded total."""
    # The weight-gradient products reduce along the rows, so a group's start is a stride of
    # the reduced dimension: CUDA's bf16 kernel wanted it 16-byte aligned (torchtitan pads to
    # 8 rows; its newer releases say torch no longer needs it) and has hung on an empty group
    # (pytorch#150374). Zero rows are free of effect, so every expert gets at least one block.
    sizes = [max(alignment, -(-count // alignment) * alignment) for count in counts]
    ends = list(itertools.accumulate(sizes))
    shifts = [end - size - start for end, size, start
              in zip(ends, sizes, itertools.accumulate([0, *counts[:-1]]))]
    total = sum(counts)
    rows = torch.arange(total, device=device) + torch.tensor(shifts, device=device)\
        .repeat_interleave(torch.tensor(counts, device=device), output_size=total)
    return rows, torch.tensor(ends, dtype=torch.int32, device=device), ends[-1]


class MoE(nn.Module):
    """A dropless mixture-of-experts feed-forward layer: ``[..., dim]`` in, ``[..., dim]`` out.

    Args:
        dim: Width of the tokens.
        hidden_dim: Width of each routed expert's hidden layer.
        num_experts: Routed experts.
        top_k: Experts each token is sent to.
        score_func: ``"softmax"`` over the experts, or an independent ``"sigmoid"`` per expert
            (DeepSeek-V3).
        normalize_scores: Rescale each token's ``top_k`` weights to sum to 1.
        route_scale: Multiply each token's ``top_k`` weights by it (after the rescaling;
            DeepSeek-V3's 2.5).
        num_shared_experts: Experts every token passes through, as one SwiGLU network of
            hidden width ``num_shared_experts * hidden_dim`` added to the output (0: none).
        aux_loss_weight: Weight of the auxiliary load-balancing loss (0: ``aux_loss`` is 0).
        bias_update_rate: Step of the auxiliary-loss-free balancing bias per optimizer step
            (None: no bias; the buffer ``expert_bias`` exists, and is checkpointed, only
            when this is set).
        aux_loss_scope: Whose expert loads ``f_i`` the auxiliary loss weighs: the call's own
            (``"micro_batch"``, the default: the loss then depends on how the batch is split
            over micro-batches and ranks), or the previous optimizer step's, summed over its
            micro-batches and the data- and context-parallel ranks (``"global_batch"``:
            Qwen's global-batch balancing, the same on every layout; kept in the buffer
            ``global_load``, checkpointed; uniform before the first step).

    Raises:
        ValueError: for a ``top_k`` outside ``1..num_experts``, an unknown ``score_func`` or
            ``aux_loss_scope``.
    """

    def __init__(self, dim: int, hidden_dim: int, num_experts: int, top_k: int, *,
                 score_func: ScoreFunc = "softmax", normalize_scores: bool = False,
                 route_scale: float = 1.0, num_shared_experts: int = 0,
                 aux_loss_weight: float = 0.0, bias_update_rate: float | None = None,
                 aux_loss_scope: AuxLossScope = "micro_batch") -> None:
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"MoE: top_k={top_k} must be between 1 and num_experts="
                             f"{num_experts}")
        if score_func not in ("softmax", "sigmoid"):
            raise ValueError(f"MoE: score_func={score_func!r} is not 'softmax' or 'sigmoid'")
        if aux_loss_scope not in ("micro_batch", "global_batch"):
            raise ValueError(f"MoE: aux_loss_scope={aux_loss_scope!r} is not 'micro_batch' or "
                             "'global_batch'")
        self.num_experts, self.top_k = num_experts, top_k
        self.score_func, self.normalize_scores = score_func, normalize_scores
        self.route_scale = route_scale
        self.aux_loss_weight, self.bias_update_rate = aux_loss_weight, bias_update_rate
        self.aux_loss_scope = aux_loss_scope
        self.router = nn.Linear(dim, num_experts, bias=False)
        self.experts = GroupedExperts(dim, hidden_dim, num_experts)
        self.shared_experts = _SwiGLU(dim, hidden_dim * num_shared_experts) \
            if num_shared_experts else None
        # Not a buffer: DDP would overwrite every rank's counts with rank 0's at each forward.
        self._load: torch.Tensor | None = None
        if bias_update_rate is not None:
            self.register_buffer("expert_bias", torch.zeros(num_experts))
        if aux_loss_scope == "global_batch":
            # The same on every rank (summed over them), so DDP's broadcast of buffers is
            # harmless; a buffer so that a resumed run weighs its first step as it would have.
            self.register_buffer("global_load", torch.zeros(num_experts))
        self.ep_group: Any | None = None
        """The expert-parallel process group when the experts are sharded over ranks (set by
        ``SetupMixin.apply_expert_parallel``), else None."""
        self.aux_loss = torch.zeros(())
        """The auxiliary loss of the latest call (a 0-dim tensor with gradient; 0 when
        ``aux_loss_weight`` is 0)."""

    @property
    def tokens_per_expert(self) -> torch.Tensor:
        """The routing slots each expert received in training forwards since the last
        ``update_bias()``, on this rank (float32, ``[num_experts]``)."""
        if self._load is None:
            return torch.zeros(self.num_experts, device=self.router.weight.device)
        return self._load

    @tokens_per_expert.setter
    def tokens_per_expert(self, counts: torch.Tensor) -> None:
        self._load = counts.detach().float()

    def reset_parameters(self) -> None:
        """Zero the balancing bias, forget the load counts and the previous step's load (the
        router and the experts reset their own weights)."""
        self._load = None
        with torch.no_grad():
            if self.bias_update_rate is not None:
                self.expert_bias.zero_()
            if self.aux_loss_scope == "global_batch":
                self.global_load.zero_()

    def route(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(experts, weights, scores)`` for ``tokens`` (``[T, dim]``): each token's chosen
        experts and their weights (``[T, top_k]``) and every expert's score (``[T, E]``, in
        float32)."""
        logits = self.router(tokens).float()
        scores = logits.softmax(dim=-1) if self.score_func == "softmax" else logits.sigmoid()
        choice = scores + self.expert_bias if self.bias_update_rate is not None else scores
        experts = choice.topk(self.top_k, dim=-1).indices
        weights = scores.gather(-1, experts)
        if self.normalize_scores:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        if self.route_scale != 1.0:
            weights = weights * self.route_scale
        return experts, weights, scores

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        tokens = x.reshape(-1, shape[-1])
        experts, weights, scores = self.route(tokens)
        slots = experts.flatten()  # token t's k-th choice at t * top_k + k
        if _BALANCED.get():
            sizes = _balanced(slots.shape[0], self.num_experts)
            counts = torch.tensor(sizes, device=tokens.device)
        else:
            counts = torch.bincount(slots, minlength=self.num_experts)
            sizes = counts.tolist()  # the one host sync of the routing
        # Within a backward (a graph task is running) a forward is activation checkpointing's
        # recomputation of one already counted.
        if self.training and not _UNCOUNTED.get() and torch._C._current_graph_task_id() == -1:
            self._load = counts.float() if self._load is None else self._load + counts
        order = slots.argsort(stable=True)
        token_of_slot = order // self.top_k
        if self.ep_group is None:
            routed = self.experts(tokens[token_of_slot], sizes)
        else:
            routed = self._across_ranks(tokens[token_of_slot], counts, sizes)
        routed = routed * weights.flatten()[order].unsqueeze(-1).to(routed.dtype)
        out = torch.zeros_like(tokens).index_add_(0, token_of_slot, routed.to(tokens.dtype))
        if self.shared_experts is not None:
            out = out + self.shared_experts(tokens)
        self.aux_loss = self._aux_loss(scores, counts)
        return out.reshape(shape)

    def _across_ranks(self, routed: torch.Tensor, counts: torch.Tensor,
                      sizes: list[int]) -> torch.Tensor:
        """Run ``routed`` (this rank's tokens, sorted by expert) on experts sharded over the
        expert-parallel group: each rank's tokens for rank r's experts go to rank r (an
        all-to-all with uneven splits), run there grouped by expert, and come back in the
        same order (the reverse all-to-all; both carry gradients)."""
        import torch.distributed as dist
        from torch.distributed._functional_collectives import (all_to_all_single_autograd,
                                                               wait_tensor)

        group = self.ep_group
        ranks = dist.get_world_size(group)
        local = self.num_experts // ranks
        sent = counts.view(ranks, local).contiguous()  # row r: for rank r's experts
        received = torch.empty_like(sent)  # row s: from rank s, for each of my experts
        dist.all_to_all_single(received, sent, group=group)
        if _BALANCED.get():  # every rank sends what this one does
            mine = dist.get_rank(group)
            rows = [sizes[mine * local:(mine + 1) * local]] * ranks
        else:
            rows = received.tolist()
        send_splits = [sum(sizes[rank * local:(rank + 1) * local]) for rank in range(ranks)]
        recv_splits = [sum(row) for row in rows]
        inbound = wait_tensor(all_to_all_single_autograd(routed, recv_splits, send_splits,
                                                         group))
        # Arrived as (source rank, expert) blocks; the experts want (expert, source rank).
        blocks = inbound.split([size for row in rows for size in row])
        by_expert = [blocks[source * local + expert]
                     for expert in range(local) for source in range(ranks)]
        # These experts' gradients add up every rank's tokens; data parallelism then averages
        # over the other data-parallel ranks only: 1/ranks makes it the mean over all.
        out = self.experts(torch.cat(by_expert), [sum(row[expert] for row in rows)
                                                  for expert in range(local)],
                           grad_scale=1.0 / ranks)
        done = out.split([block.shape[0] for block in by_expert])
        by_source = [done[expert * ranks + source]
                     for source in range(ranks) for expert in range(local)]
        return wait_tensor(all_to_all_single_autograd(torch.cat(by_source), send_splits,
                                                      recv_splits, group))

    def _aux_loss(self, scores: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        if not self.aux_loss_weight:
            return scores.new_zeros(())
        if self.aux_loss_scope == "micro_batch":
            load = counts.float() * self.num_experts / (self.top_k * scores.shape[0])
        else:  # f_i from the step before, a constant here; uniform while there was none
            total = self.global_load.sum()
            load = torch.where(total > 0, self.global_load * self.num_experts
                               / total.clamp_min(1), torch.ones_like(self.global_load))
        probability = (scores / scores.sum(dim=-1, keepdim=True)).mean(dim=0)  # P_i
        return self.aux_loss_weight * (load * probability).sum()

    @torch.no_grad()
    def update_bias(self, group: Any | None = None) -> None:
        """Move ``expert_bias`` by ``bias_update_rate`` towards the experts that received
        fewer routing slots than the mean since the last update (away from those above),
        keep those counts as ``global_load`` with ``aux_loss_scope="global_batch"``, then
        reset the counts. With ``group``, the counts are first summed over its ranks (a
        collective), so that every rank uses the whole batch's load. Without bias balancing
        or a global auxiliary loss only the counts are reset (no collective).
        """
        if self.bias_update_rate is not None or self.aux_loss_scope == "global_batch":
            counts = self.tokens_per_expert.clone()
            if group is not None:
                import torch.distributed as dist

                dist.all_reduce(counts, group=group)
            if self.bias_update_rate is not None:
                self.expert_bias += self.bias_update_rate * torch.sign(counts.mean() - counts)
            if self.aux_loss_scope == "global_batch":
                self.global_load.copy_(counts)
        self._load = None


class _SwiGLU(nn.Module):
    def __init__(self, dim: int, hidden_dim: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class _ScaleGradient(torch.autograd.Function):
    """Identity forward; the gradient multiplied by ``scale``."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad * ctx.scale, None


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (the experts of this rank under expert parallelism)."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def moe_layers(model: nn.Module) -> Iterator[MoE]:
    """Every ``MoE`` layer of ``model``."""
    return (module for module in model.modules() if isinstance(module, MoE))


def active_parameters(model: nn.Module) -> int:
    """The parameters one token passes through: all of ``model``'s, except that of each
    ``MoE`` layer's routed experts only ``top_k`` of ``num_experts`` count. Full shapes are
    counted, however the parameters are sharded (for MFU: ``6 * active_parameters(model)``
    FLOPs per token, plus attention's)."""
    total = sum(param.shape.numel() for param in model.parameters())
    for layer in moe_layers(model):
        experts = sum(param.shape.numel() for param in layer.experts.parameters())
        total -= experts * (layer.num_experts - layer.top_k) // layer.num_experts
    return total


def update_expert_biases(model: nn.Module, group: Any | None = None) -> None:
    """``update_bias(group)`` on every ``MoE`` layer of ``model`` (each a collective over
    ``group`` when it balances with a bias); nothing for a model without one."""
    for layer in moe_layers(model):
        layer.update_bias(group)
