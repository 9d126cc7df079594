"""A mixture-of-experts module laid out as torchtitan's (0.2/0.3) is, written here from its
documented behaviour (torchtitan is not a dependency), and a tiny model built from it.

Layout: ``router.gate`` (``nn.Linear(dim, E)``, no bias) with ``top_k``, ``score_func``,
``route_norm``, ``route_scale``; ``experts.w1``/``w3`` ``[E, hidden, dim]`` and ``w2``
``[E, dim, hidden]``, applied as ``nn.Linear`` weights are (``x @ w.T``); optional
``shared_experts`` (``w1``/``w2``/``w3`` linears); the buffers ``expert_bias`` (persistent,
when ``load_balance_coeff`` is set) and ``tokens_per_expert`` (not persistent). Scores come
in float32; the bias only steers the choice; the chosen scores are optionally normalized
(plus 1e-20), scaled, and weigh the experts' outputs, summed per token in float32.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

DIM, HIDDEN, EXPERTS, TOP_K = 8, 12, 4, 2


class TitanRouter(nn.Module):
    def __init__(self, dim: int, num_experts: int, top_k: int,
                 score_func: Literal["softmax", "sigmoid"] = "softmax",
                 route_norm: bool = False, route_scale: float = 1.0,
                 gate_bias: bool = False) -> None:
        super().__init__()
        self.gate = nn.Linear(dim, num_experts, bias=gate_bias)
        self.num_experts, self.top_k = num_experts, top_k
        self.score_func, self.route_norm, self.route_scale = score_func, route_norm, route_scale
        self.num_expert_groups: int | None = None
        self._debug_force_load_balance = False

    def forward(self, x: torch.Tensor, bias: torch.Tensor | None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self.gate(x).float()
        scores = logits.softmax(dim=1) if self.score_func == "softmax" else logits.sigmoid()
        steered = scores if bias is None else scores + bias
        chosen = steered.topk(self.top_k, dim=-1, sorted=False).indices
        weights = scores.gather(1, chosen)
        if self.route_norm:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * self.route_scale, chosen


class TitanExperts(nn.Module):
    def __init__(self, dim: int, hidden: int, num_experts: int) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(num_experts, hidden, dim))
        self.w2 = nn.Parameter(torch.empty(num_experts, dim, hidden))
        self.w3 = nn.Parameter(torch.empty(num_experts, hidden, dim))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        for weight in (self.w1, self.w2, self.w3):
            nn.init.trunc_normal_(weight, std=0.2)

    def forward(self, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        outputs = []
        for expert, rows in enumerate(x.split(counts)):
            hidden = F.silu(rows @ self.w1[expert].T) * (rows @ self.w3[expert].T)
            outputs.append(hidden @ self.w2[expert].T)
        return torch.cat(outputs)


class TitanFeedForward(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TitanMoE(nn.Module):
    """torchtitan's MoE layout: ``[bs, seq, dim]`` in and out."""

    def __init__(self, dim: int = DIM, hidden: int = HIDDEN, num_experts: int = EXPERTS,
                 top_k: int = TOP_K, *, score_func: Literal["softmax", "sigmoid"] = "softmax",
                 route_norm: bool = False, route_scale: float = 1.0,
                 num_shared_experts: int = 0, load_balance_coeff: float | None = None,
                 score_before_experts: bool = False) -> None:
        super().__init__()
        self.experts = TitanExperts(dim, hidden, num_experts)
        self.router = TitanRouter(dim, num_experts, top_k, score_func, route_norm, route_scale)
        self.shared_experts = TitanFeedForward(dim, hidden * num_shared_experts) \
            if num_shared_experts else None
        self.score_before_experts = score_before_experts
        self.load_balance_coeff = load_balance_coeff
        if load_balance_coeff is not None:
            self.register_buffer("expert_bias", torch.zeros(num_experts), persistent=True)
        else:
            self.expert_bias = None
        self.register_buffer("tokens_per_expert", torch.zeros(num_experts), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        weights, chosen = self.router(flat, self.expert_bias)
        counts = torch.bincount(chosen.flatten(), minlength=self.router.num_experts)
        with torch.no_grad():
            self.tokens_per_expert += counts
        order = chosen.flatten().argsort(stable=True)
        rows = flat[order // self.router.top_k]
        if self.score_before_experts:
            rows = (rows.float() * weights.flatten()[order].unsqueeze(-1)).to(x.dtype)
        done = self.experts(rows, counts.tolist())
        unsorted = torch.zeros_like(done).index_copy(0, order, done)
        per_token = unsorted.view(-1, self.router.top_k, shape[-1])
        if self.score_before_experts:
            out = per_token.sum(dim=1)
        else:
            out = torch.bmm(weights.unsqueeze(1), per_token.float()).squeeze(1).to(x.dtype)
        if self.shared_experts is not None:
            out = out + self.shared_experts(flat)
        return out.reshape(shape)


class TitanBlock(nn.Module):
    """A residual block around a torchtitan-style MoE (``moe``)."""

    def __init__(self, **moe: object) -> None:
        super().__init__()
        self.moe = TitanMoE(**moe)  # type: ignore[arg-type]

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.moe(h)


class TitanModel(nn.Module):
    """A regression through ``layers`` residual blocks, each a torchtitan-style MoE."""

    def __init__(self, layers: int = 2, **moe: object) -> None:
        super().__init__()
        self.embed = nn.Linear(4, DIM)
        self.layers = nn.ModuleList(TitanBlock(**moe) for _ in range(layers))
        self.head = nn.Linear(DIM, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for layer in self.layers:
            if layer is not None:
                h = layer(h)
        return self.head(h)
