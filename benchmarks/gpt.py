"""A GPT-style decoder shared by the benchmarks: pre-norm blocks in an ``nn.ModuleList``.

The blocks live in a ``ModuleList`` so dream_trainer's default policies (FSDP2 units,
per-block compilation) find them, and the hand-written loops treat them the same way.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class GPTShape:
    vocab: int = 50304
    d_model: int = 2048
    n_layers: int = 16
    n_heads: int = 16
    seq_len: int = 2048
    n_kv_heads: int | None = None
    """Key and value heads (grouped-query attention); None: as many as ``n_heads``."""
    ffn_dim: int | None = None
    """The feed-forward network's hidden width; None: ``4 * d_model``."""
    swiglu: bool = False
    """A SwiGLU feed-forward network (its gate and up projections one ``Linear``) instead of
    GELU's."""

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def hidden(self) -> int:
        return self.ffn_dim or 4 * self.d_model

    def flops_per_token(self, n_params: int) -> float:
        """Training FLOPs per token: 6 per weight multiply-add outside the embeddings, plus the
        attention scores and their use (``12 * layers * d_model * seq_len``, counted in full
        although causal attention needs half, as in the PaLM paper's MFU definition)."""
        embedding = (self.vocab + self.seq_len) * self.d_model
        return 6 * (n_params - embedding) + 12 * self.n_layers * self.d_model * self.seq_len


class Block(nn.Module):
    def __init__(self, shape: GPTShape) -> None:
        super().__init__()
        d = shape.d_model
        self.n_heads, self.kv_heads, self.swiglu = shape.n_heads, shape.kv_heads, shape.swiglu
        self.kv_dim = d // shape.n_heads * shape.kv_heads
        self.attn_norm = nn.LayerNorm(d, bias=False)
        self.qkv = nn.Linear(d, d + 2 * self.kv_dim, bias=False)
        self.proj = nn.Linear(d, d, bias=False)
        self.mlp_norm = nn.LayerNorm(d, bias=False)
        self.up = nn.Linear(d, shape.hidden * (2 if shape.swiglu else 1), bias=False)
        self.down = nn.Linear(shape.hidden, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        head_dim = d // self.n_heads
        q, k, v = self.qkv(self.attn_norm(x)).split([d, self.kv_dim, self.kv_dim], dim=-1)
        q = q.view(b, t, self.n_heads, head_dim).transpose(1, 2)
        k, v = (part.view(b, t, self.kv_heads, head_dim).transpose(1, 2) for part in (k, v))
        grouped = {"enable_gqa": True} if self.kv_heads != self.n_heads else {}
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True, **grouped)
        x = x + self.proj(attended.transpose(1, 2).reshape(b, t, d))
        hidden = self.up(self.mlp_norm(x))
        if self.swiglu:
            gate, up = hidden.chunk(2, dim=-1)
            hidden = F.silu(gate) * up
        else:
            hidden = F.gelu(hidden, approximate="tanh")
        return x + self.down(hidden)


class GPT(nn.Module):
    def __init__(self, shape: GPTShape) -> None:
        super().__init__()
        self.token_embedding = nn.Embedding(shape.vocab, shape.d_model)
        self.position_embedding = nn.Embedding(shape.seq_len, shape.d_model)
        self.blocks = nn.ModuleList(Block(shape) for _ in range(shape.n_layers))
        self.norm = nn.LayerNorm(shape.d_model, bias=False)
        self.head = nn.Linear(shape.d_model, shape.vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.token_embedding(tokens) + self.position_embedding(positions)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


LLAMA3_8B_WIDTHS = GPTShape(vocab=128256, d_model=4096, n_layers=32, n_heads=32, seq_len=8192,
                            n_kv_heads=8, ffn_dim=14336, swiglu=True)
"""Llama 3 8B's widths (its vocabulary, model and SwiGLU widths, 32 query and 8 key/value
heads, 8K context) in this decoder, which keeps learned positions and LayerNorm: the matrix
products, and so the float8 gains, are an 8B model's; ``gpu_throughput`` chooses how many
of its 32 layers fit one GPU."""


def init_gpt(model: nn.Module) -> None:
    """GPT-2's initialization: N(0, 0.02) weights, unit norm scales."""
    for module in model.modules():
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)
        elif isinstance(module, nn.LayerNorm):
            nn.init.ones_(module.weight)


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
