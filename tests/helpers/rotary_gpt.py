"""A tiny causal GPT with rotary positions read from a per-block position table, and its
trainer: the model of the context-parallelism tests.

The table is a buffer indexed by position (``angles[:seq_len]``), so context parallelism
must cut it with the sequence (``context_parallel_buffers``); every block holds its own,
so a pipeline stage has the tables of its blocks.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.utils.data import DataLoader, TensorDataset

from dream_trainer import BaseTrainer, BaseTrainerConfig
from dream_trainer.mixins import SetupConfigMixin, SetupMixin

VOCAB, DIM, HEAD_DIM, MAX_LEN = 32, 16, 4, 64
IGNORE = -100


class Rotary(nn.Module):
    """``angles[p, i] = p / 10000^(2i / head_dim)``: the rotation of position ``p``."""

    def __init__(self, head_dim: int = HEAD_DIM, max_len: int = MAX_LEN) -> None:
        super().__init__()
        self.head_dim, self.max_len = head_dim, max_len
        self.register_buffer("angles", torch.empty(max_len, head_dim // 2), persistent=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        inverse = 1.0 / 10000 ** (torch.arange(0, self.head_dim, 2).float() / self.head_dim)
        positions = torch.arange(self.max_len).float()
        self.angles = torch.outer(positions, inverse).to(self.angles.device)

    def forward(self, x: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """Rotate ``x`` of ``[batch, heads, seq, head_dim]`` by its positions' angles: those
        of ``positions`` (``[batch, seq]``, packed documents'), else ``0, 1, ...``."""
        angles = self.angles[: x.size(-2)] if positions is None \
            else self.angles[positions].unsqueeze(1)
        cos, sin = angles.cos(), angles.sin()
        even, odd = x[..., 0::2], x[..., 1::2]
        return torch.stack((even * cos - odd * sin, even * sin + odd * cos), -1).flatten(-2)


class Block(nn.Module):
    def __init__(self, dim: int = DIM) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.q, self.k, self.v, self.o = (nn.Linear(dim, dim) for _ in range(4))
        self.rope = Rotary()
        self.norm2 = nn.LayerNorm(dim)
        self.w1 = nn.Linear(dim, 4 * dim)
        self.w2 = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        h = self.norm1(x)
        batch, seq, _ = h.shape
        # Heads from the projection's width: a column-parallel projection holds some of them.
        q, k, v = (proj(h).view(batch, seq, -1, HEAD_DIM).transpose(1, 2)
                   for proj in (self.q, self.k, self.v))
        attn = F.scaled_dot_product_attention(self.rope(q, positions), self.rope(k, positions), v,
                                              is_causal=True)
        x = x + self.o(attn.transpose(1, 2).reshape(batch, seq, -1))
        return x + self.feed_forward(self.norm2(x))

    def feed_forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.w2(F.gelu(self.w1(h)))


class RotaryGPT(nn.Module):
    """Skips modules that are None (those other pipeline stages hold)."""

    def __init__(self, layers: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(Block() for _ in range(layers))
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, x: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        if self.embed is not None:
            x = self.embed(x)
        for layer in self.layers:
            if layer is not None:
                x = layer(x, positions)
        if self.norm is not None:
            x = self.head(self.norm(x))
        return x


def summed_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Cross-entropy summed over the tokens that count (``num_items`` of them)."""
    return F.cross_entropy(logits.reshape(-1, VOCAB).float(), targets.reshape(-1),
                           ignore_index=IGNORE, reduction="sum")


def mean_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, VOCAB).float(), targets.reshape(-1),
                           ignore_index=IGNORE)


def sequences(count: int, length: int, seed: int) -> torch.Tensor:
    """``count`` random token sequences of ``length + 1``."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (count, length + 1), generator=generator)


def targets_of(tokens: torch.Tensor, ignore: bool = True) -> torch.Tensor:
    """The next tokens; with ``ignore``, about one in five of the first half is ignored, so
    that the parts of a sequence count different numbers of tokens."""
    targets = tokens[:, 1:].clone()
    if ignore:
        first_half = torch.arange(targets.size(1), device=targets.device) < targets.size(1) // 2
        targets[(targets % 5 == 0) & first_half] = IGNORE
    return targets


class GPTConfig(BaseTrainerConfig, SetupConfigMixin):
    lr: float = 0.1
    n_sequences: int = 16
    seq_len: int = 16
    n_layers: int = 2
    summed: bool = True
    """Train on the summed loss with ``num_items`` (else the mean loss)."""


class RotaryGPTTrainer(BaseTrainer, SetupMixin):
    """Trains ``RotaryGPT`` through ``forward_backward`` with SGD."""

    config: GPTConfig

    def configure_models(self) -> None:
        self.model = RotaryGPT(self.config.n_layers)

    def context_parallel_buffers(self) -> dict[str, int]:
        return {"model.layers.*.rope.angles": 0}

    def apply_tensor_parallel(self, tp_mesh: DeviceMesh) -> None:
        from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                       parallelize_module)

        plan = {"q": ColwiseParallel(), "k": ColwiseParallel(), "v": ColwiseParallel(),
                "o": RowwiseParallel(), "w1": ColwiseParallel(), "w2": RowwiseParallel()}
        for block in self.model.layers:
            if block is not None:
                parallelize_module(block, tp_mesh, plan)

    def configure_optimizers(self) -> None:
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=self.config.lr)

    def configure_dataloaders(self) -> tuple[DataLoader[Any], DataLoader[Any]]:
        config = self.config
        batch = config.training_parameters.train_batch_size
        train = TensorDataset(sequences(config.n_sequences, config.seq_len, 3))
        val = TensorDataset(sequences(8, config.seq_len, 4))
        return DataLoader(train, batch_size=batch), DataLoader(val, batch_size=batch)

    def training_step(self, batch: Any, batch_idx: int) -> dict[str, Any]:
        (tokens,) = batch
        # A mean loss is the mean of the parts' means only when they count the same tokens.
        targets = targets_of(tokens, ignore=self.config.summed)
        if self.config.summed:
            loss = self.forward_backward(self.model, tokens[:, :-1], target=targets,
                                         loss_fn=summed_loss,
                                         num_items=(targets != IGNORE).sum())
        else:
            loss = self.forward_backward(self.model, tokens[:, :-1], target=targets,
                                         loss_fn=mean_loss)
        if self.is_accumulating_gradients:
            return {"loss": loss}
        return {"loss": loss, "grad_norm": self.step(self.model, self.optimizer)}

    def validation_step(self, batch: Any, batch_idx: int) -> dict[str, Any]:
        (tokens,) = batch
        targets = targets_of(tokens)
        count = (targets != IGNORE).sum()
        total = self.forward_loss(self.model, tokens[:, :-1], target=targets,
                                  loss_fn=summed_loss, num_items=count)
        return {"val_loss": total / count}


class HandWrittenTrainer(RotaryGPTTrainer):
    """The same steps written by hand inside ``context_parallel``, with ``backward``."""

    def training_step(self, batch: Any, batch_idx: int) -> dict[str, Any]:
        (tokens,) = batch
        targets = targets_of(tokens)
        count = (targets != IGNORE).sum()  # the whole sequences' tokens, before the split
        with self.context_parallel(tokens[:, :-1], targets) as (inputs, part):
            loss = summed_loss(self.model(inputs), part)
            self.backward(loss, num_items=count)
        if self.is_accumulating_gradients:
            return {"loss": loss}
        return {"loss": loss, "grad_norm": self.step(self.model, self.optimizer)}
