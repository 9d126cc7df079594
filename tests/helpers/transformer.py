"""A tiny causal transformer trainer, with a tensor-parallel plan, for the parallelism tests."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.utils.data import DataLoader, TensorDataset

from dream_trainer import BaseTrainer, BaseTrainerConfig
from dream_trainer.configs import DeviceParameters, TrainingParameters
from dream_trainer.mixins import SetupConfigMixin, SetupMixin

VOCAB, DIM, HEAD_DIM, SEQ, LAYERS = 32, 16, 4, 8, 2


class Block(nn.Module):
    def __init__(self, dim: int = DIM, hidden: int = 4 * DIM) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.q, self.k, self.v = (nn.Linear(dim, dim) for _ in range(3))
        self.o = nn.Linear(dim, dim)
        self.norm2 = nn.LayerNorm(dim)
        self.w1 = nn.Linear(dim, hidden)
        self.w2 = nn.Linear(hidden, dim)

    def attend(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` plus causal self-attention over it."""
        h = self.norm1(x)
        batch, seq, _ = h.shape
        # Heads are inferred from the projection's width, so a column-parallel projection
        # carries only this rank's heads.
        q, k, v = (proj(h).view(batch, seq, -1, HEAD_DIM).transpose(1, 2)
                   for proj in (self.q, self.k, self.v))
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return x + self.o(attn.transpose(1, 2).reshape(batch, seq, -1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.attend(x)
        return x + self.w2(F.gelu(self.w1(self.norm2(x))))


class TinyTransformer(nn.Module):
    """Follows the pipeline convention: ``forward`` skips modules that are None (those that
    other pipeline stages hold)."""

    def __init__(self, layers: int = LAYERS, dim: int = DIM,
                 block: Callable[[], nn.Module] = Block) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, dim)
        self.layers = nn.ModuleList(block() for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, VOCAB)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.embed is not None:
            x = self.embed(x)
        for layer in self.layers:
            if layer is not None:
                x = layer(x)
        if self.norm is not None:
            x = self.norm(x)
        if self.head is not None:
            x = self.head(x)
        return x


class TransformerConfig(BaseTrainerConfig, SetupConfigMixin):
    lr: float = 0.05
    n_sequences: int = 64
    n_layers: int = LAYERS


def transformer_config(device_parameters: DeviceParameters, batch: int,
                       **training: Any) -> TransformerConfig:
    return TransformerConfig(project="tiny", group="tests", experiment="transformer",
                             device_parameters=device_parameters,
                             training_parameters=TrainingParameters(
                                 n_epochs=1, train_batch_size=batch, **training))


class TransformerTrainer(BaseTrainer, SetupMixin):
    config: TransformerConfig

    def configure_models(self) -> None:
        self.model = TinyTransformer(self.config.n_layers)

    def apply_tensor_parallel(self, tp_mesh: DeviceMesh) -> None:
        from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                       parallelize_module)

        plan = {"q": ColwiseParallel(), "k": ColwiseParallel(), "v": ColwiseParallel(),
                "o": RowwiseParallel(), "w1": ColwiseParallel(), "w2": RowwiseParallel()}
        for block in self.model.layers:
            if block is not None:  # under a pipeline, blocks of other stages are None
                parallelize_module(block, tp_mesh, plan)

    def configure_optimizers(self) -> None:
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=self.config.lr)

    def configure_dataloaders(self) -> tuple[DataLoader[Any], None]:
        generator = torch.Generator().manual_seed(3)
        tokens = torch.randint(0, VOCAB, (self.config.n_sequences, SEQ + 1), generator=generator)
        loader = DataLoader(TensorDataset(tokens),
                            batch_size=self.config.training_parameters.train_batch_size)
        return loader, None

    def training_step(self, batch: Any, batch_idx: int) -> dict[str, Any]:
        (tokens,) = batch
        logits = self.model(tokens[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, VOCAB).float(), tokens[:, 1:].reshape(-1))
        self.backward(loss)
        if not self.is_accumulating_gradients:
            return {"loss": loss, "grad_norm": self.step(self.model, self.optimizer)}
        return {"loss": loss}

    def validation_step(self, batch: Any, batch_idx: int) -> dict[str, Any]:
        return {}


def next_token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of next-token logits ``(batch, seq, vocab)``."""
    return F.cross_entropy(logits.reshape(-1, VOCAB).float(), targets.reshape(-1))


class StepAPITrainer(TransformerTrainer):
    """The tiny transformer trained through ``forward_backward``/``forward_loss``: this
    training_step runs unchanged with and without a pipeline."""

    def configure_dataloaders(self) -> tuple[DataLoader[Any], DataLoader[Any]]:
        train, _ = super().configure_dataloaders()
        generator = torch.Generator().manual_seed(4)
        tokens = torch.randint(0, VOCAB, (16, SEQ + 1), generator=generator)
        val = DataLoader(TensorDataset(tokens),
                         batch_size=self.config.training_parameters.val_batch_size)
        return train, val

    def training_step(self, batch: Any, batch_idx: int) -> dict[str, Any]:
        (tokens,) = batch
        loss = self.forward_backward(self.model, tokens[:, :-1], target=tokens[:, 1:],
                                     loss_fn=next_token_loss)
        if not self.is_accumulating_gradients:
            return {"loss": loss, "grad_norm": self.step(self.model, self.optimizer)}
        return {"loss": loss}

    def validation_step(self, batch: Any, batch_idx: int) -> dict[str, Any]:
        (tokens,) = batch
        return {"val_loss": self.forward_loss(self.model, tokens[:, :-1], target=tokens[:, 1:],
                                              loss_fn=next_token_loss)}
