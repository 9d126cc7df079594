"""A small GPT for the ``dream-trainer plan`` tests, with shapes the analytic figures can follow.

    dream-trainer plan tests/scripts/plan_trainer.py:make_trainer --world-size 8,64,1024 \\
        -- --device_parameters.dp_shard auto --device_parameters.tensor_parallel 4

Blocks are pre-norm attention (bias-free ``q``, ``k``, ``v``, ``o``; heads inferred from the
projection's width, so a column-parallel projection carries only its rank's heads) and an MLP
(``up`` to ``4 * DIM``, ``down``), with an ``RMSNorm`` before each; AdamW over every
parameter. ``make_trainer``'s ``plan_batch()`` gives a micro-batch of random tokens;
``make_loader_trainer``'s has none, so a plan draws from its loader.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.utils.data import DataLoader, TensorDataset

from dream_trainer import BaseTrainer, BaseTrainerConfig
from dream_trainer.configs import DeviceParameters, TrainingParameters, apply_cli_overrides
from dream_trainer.mixins import SetupConfigMixin, SetupMixin

VOCAB, DIM, HEAD_DIM, SEQ, LAYERS, BATCH = 128, 64, 8, 16, 2, 2
TP_PLAN = {"q": "colwise", "k": "colwise", "v": "colwise", "o": "rowwise",
           "up": "colwise", "down": "rowwise"}


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn_norm = nn.RMSNorm(DIM)
        self.q, self.k, self.v, self.o = (nn.Linear(DIM, DIM, bias=False) for _ in range(4))
        self.mlp_norm = nn.RMSNorm(DIM)
        self.up = nn.Linear(DIM, 4 * DIM, bias=False)
        self.down = nn.Linear(4 * DIM, DIM, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.attn_norm(x)
        batch, seq, _ = h.shape
        q, k, v = (proj(h).view(batch, seq, -1, HEAD_DIM).transpose(1, 2)
                   for proj in (self.q, self.k, self.v))
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o(attended.transpose(1, 2).reshape(batch, seq, -1))
        return x + self.feed_forward(self.mlp_norm(x))

    def feed_forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x)))


class PlannedGPT(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(Block() for _ in range(LAYERS))
        self.norm = nn.RMSNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # The pipeline convention: modules other stages hold are None, and skipped.
        if self.embed is not None:
            x = self.embed(x)
        for layer in self.layers:
            if layer is not None:
                x = layer(x)
        if self.norm is not None:
            x = self.norm(x)
        return self.head(x) if self.head is not None else x


class PlanConfig(BaseTrainerConfig, SetupConfigMixin):
    samples: int = 2048
    """Sequences in the train loader: one batch per rank at 1,024 data-parallel ranks."""
    val_samples: int = 0
    """Sequences in a validation loader of ``train_batch_size`` batches; 0: no validation."""
    plan_rows: int | None = None
    """Rows of ``plan_batch()``'s tensors; ``None``: ``train_batch_size``, as it should be."""
    print_loss: bool = False
    """Print the loss in ``training_step`` (a value a plan's fake tensors do not have)."""


class LoaderPlanTrainer(BaseTrainer, SetupMixin):
    """Without ``plan_batch()``: a plan draws its batch from the train loader."""

    config: PlanConfig

    def configure_models(self) -> None:
        self.model = PlannedGPT()

    def apply_tensor_parallel(self, tp_mesh: DeviceMesh) -> None:
        from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                       parallelize_module)

        styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
        for block in self.model.layers:
            parallelize_module(block, tp_mesh,
                               {name: styles[style]() for name, style in TP_PLAN.items()})

    def configure_optimizers(self) -> None:
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-3)

    def configure_dataloaders(self) -> tuple[DataLoader[Any], DataLoader[Any] | None]:
        tokens = torch.randint(0, VOCAB, (self.config.samples + self.config.val_samples,
                                          SEQ + 1), generator=torch.Generator().manual_seed(0))
        batch_size = self.config.training_parameters.train_batch_size
        train = DataLoader(TensorDataset(tokens[:self.config.samples]), drop_last=True,
                           batch_size=batch_size)
        val = DataLoader(TensorDataset(tokens[self.config.samples:]), batch_size=batch_size)
        return train, val if self.config.val_samples else None

    def training_step(self, batch: Any, batch_idx: int) -> dict[str, Any]:
        (tokens,) = batch
        logits = self.model(tokens[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))
        self.backward(loss)
        if self.config.print_loss:
            print(f"loss {loss.item():.3f}")
        if not self.is_accumulating_gradients:
            self.step(self.model, self.optimizer)
        return {"loss": loss}

    def validation_step(self, batch: Any, batch_idx: int) -> dict[str, Any]:
        return {}


class PlanTrainer(LoaderPlanTrainer):
    def plan_batch(self) -> tuple[torch.Tensor]:
        rows = self.config.plan_rows or self.config.training_parameters.train_batch_size
        return (torch.randint(0, VOCAB, (rows, SEQ + 1)),)


class PipelinePlanTrainer(PlanTrainer):
    """The same GPT through ``forward_backward``, so that it also runs as a pipeline."""

    def training_step(self, batch: Any, batch_idx: int) -> dict[str, Any]:
        (tokens,) = batch
        loss = self.forward_backward(self.model, tokens[:, :-1], target=tokens[:, 1:],
                                     loss_fn=next_token_loss)
        if not self.is_accumulating_gradients:
            self.step(self.model, self.optimizer)
        return {"loss": loss}


def next_token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


def config(args: Sequence[str] | None) -> PlanConfig:
    return apply_cli_overrides(PlanConfig(
        project="plan", group="tests", experiment="gpt",
        device_parameters=DeviceParameters.FSDP(),
        training_parameters=TrainingParameters(n_epochs=1, train_batch_size=BATCH)), args)


def make_trainer(args: Sequence[str] | None = None) -> PlanTrainer:
    return PlanTrainer(config(args))


def make_loader_trainer(args: Sequence[str] | None = None) -> LoaderPlanTrainer:
    return LoaderPlanTrainer(config(args))


def make_pipeline_trainer(args: Sequence[str] | None = None) -> PipelinePlanTrainer:
    return PipelinePlanTrainer(config(args))


EXPERTS, TOP_K = 8, 2


class MoEBlock(Block):
    """``Block`` whose MLP is an ``MoE`` of ``EXPERTS`` SwiGLU experts (hidden ``2 * DIM``)."""

    def __init__(self) -> None:
        super().__init__()
        from dream_trainer.nn import MoE

        del self.up, self.down
        self.moe = MoE(DIM, 2 * DIM, EXPERTS, TOP_K, bias_update_rate=1e-3)

    def feed_forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.moe(x)


class MoEPlanTrainer(PlanTrainer):
    """``PlannedGPT`` with an MoE in every block."""

    def configure_models(self) -> None:
        super().configure_models()
        self.model.layers = nn.ModuleList(MoEBlock() for _ in range(LAYERS))


def make_moe_trainer(args: Sequence[str] | None = None) -> MoEPlanTrainer:
    return MoEPlanTrainer(config(args))
