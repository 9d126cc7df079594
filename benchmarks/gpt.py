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
        self.n_heads = shape.n_heads
        self.attn_norm = nn.LayerNorm(d, bias=False)
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.proj = nn.Linear(d, d, bias=False)
        self.mlp_norm = nn.LayerNorm(d, bias=False)
        self.up = nn.Linear(d, 4 * d, bias=False)
        self.down = nn.Linear(4 * d, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = (self.qkv(self.attn_norm(x)).view(b, t, 3, self.n_heads, d // self.n_heads)
                   .permute(2, 0, 3, 1, 4))
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attended.transpose(1, 2).reshape(b, t, d))
        return x + self.down(F.gelu(self.up(self.mlp_norm(x)), approximate="tanh"))


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


def init_gpt(model: nn.Module) -> None:
    """GPT-2's initialization: N(0, 0.02) weights, unit norm scales."""
    for module in model.modules():
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)
        elif isinstance(module, nn.LayerNorm):
            nn.init.ones_(module.weight)


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
