"""Script: train a small GPT with float8 Linear layers (emulated on the CPU) in one parallel
layout, and record what the float8 tests check.

Usage: float8_run.py OUT ROOT LAYOUT [KILL_POINT ...]

``LAYOUT`` is ``fsdp`` (2 ranks: FSDP2 with float8 all-gather, a resume without float8 and
one back with it, DDP, the rowwise_with_gw_hp recipe, and 2 pipeline stages with each
recipe), ``tp_fsdp`` (4 ranks: tensor parallel 2 x FSDP2 2) or ``kill`` (one plain process,
resumed from its last checkpoint and SIGKILLed at each ``KILL_POINT`` of
``tests.helpers.checkpointing.Killer``). One process runs the same trainer in-process
(``tests/parallel/test_float8.py``).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader, TensorDataset

from dream_trainer.callbacks import EMA, Callback, Histograms
from dream_trainer.configs import CheckpointParameters, DeviceParameters, TrainingParameters
from dream_trainer.configs.logging import LoggingConfigMixin
from dream_trainer.mixins import CheckpointConfigMixin, CheckpointMixin, LoggerMixin
from dream_trainer.parallel.float8 import float8_tensor_parallel_styles
from tests.helpers.checkpointing import Killer
from tests.helpers.launch import save_on_rank_zero
from tests.helpers import transformer
from tests.helpers.transformer import StepAPITrainer, TransformerConfig, TransformerTrainer

DIM = 32
LOW_RANK = 24  # not a multiple of 16: the adapter's two layers stay in high precision
GLOBAL_BATCH = 8
STEPS = 4
CONVERTED = sorted(f"layers.{i}.{name}" for i in range(2)
                   for name in ("q", "k", "v", "o", "w1", "w2"))
"""The layers the default filter converts: not the head, not the misaligned adapter."""


class Block(transformer.Block):
    """The tiny transformer's block, wider, with a low-rank adapter beside its MLP."""

    def __init__(self) -> None:
        super().__init__(DIM, 2 * DIM)
        self.down = nn.Linear(DIM, LOW_RANK)
        self.up = nn.Linear(LOW_RANK, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.attend(x)
        h = self.norm2(x)
        return x + self.w2(F.gelu(self.w1(h))) + self.up(self.down(h))


def gpt() -> nn.Module:
    return transformer.TinyTransformer(layers=2, dim=DIM, block=Block)


class Float8Config(TransformerConfig, CheckpointConfigMixin, LoggingConfigMixin):
    ranks_as_micro_batches: bool = False
    """Read each batch's micro-batches as that many data-parallel ranks would, one rank's
    share per micro-batch: one process accumulating them computes what the ranks compute,
    per-rank tensorwise float8 scales included. Otherwise micro-batches are consecutive
    samples, as a pipeline splits a batch."""


def full(tensor: torch.Tensor) -> torch.Tensor:
    return (tensor.full_tensor() if isinstance(tensor, DTensor) else tensor).detach().clone()


def unwrapped(model: nn.Module) -> nn.Module:
    return getattr(model, "module", model)  # DDP prefixes names with module.


def local_type(tensor: torch.Tensor) -> str:
    return type(tensor.to_local() if isinstance(tensor, DTensor) else tensor).__name__


class Float8Trainer(TransformerTrainer, CheckpointMixin, LoggerMixin):
    """The GPT, with float8-aware tensor-parallel styles; keeps what the tests compare,
    histograms included (rank 0 logs them)."""

    config: Float8Config
    histograms: dict[str, torch.Tensor]

    def log_histogram(self, key: str, values: torch.Tensor) -> None:
        super().log_histogram(key, values)
        self.histograms[f"{key}@{self.global_step}"] = values.clone()

    def configure_models(self) -> None:
        self.model = gpt()

    def configure_dataloaders(self) -> tuple[DataLoader[Any], None]:
        loader, _ = super().configure_dataloaders()
        if not self.config.ranks_as_micro_batches:
            return loader, None
        ranks = self.config.training_parameters.gradient_accumulation_steps
        # Rank r reads samples r, r + R, ... of each global batch (the framework's sampler).
        (tokens,) = loader.dataset.tensors  # type: ignore[attr-defined]
        order = torch.arange(len(tokens)).view(-1, loader.batch_size, ranks).transpose(1, 2)
        return DataLoader(TensorDataset(tokens[order.reshape(-1)]),
                          batch_size=loader.batch_size), None

    def apply_tensor_parallel(self, tp_mesh: DeviceMesh) -> None:
        from torch.distributed.tensor.parallel import parallelize_module

        colwise, rowwise, _ = float8_tensor_parallel_styles(self.model)
        self.tp_styles = (colwise.__name__, rowwise.__name__)
        plan = {"q": colwise(), "k": colwise(), "v": colwise(), "o": rowwise(),
                "w1": colwise(), "w2": rowwise()}
        for block in self.model.layers:
            parallelize_module(block, tp_mesh, plan)

    def post_setup(self) -> None:
        self.histograms = {}
        self.layer_types = {name: type(module).__name__
                            for name, module in self.model.named_modules()
                            if isinstance(module, nn.Linear)}
        self.weight_types = {name: local_type(param)
                             for name, param in self.model.named_parameters()}
        self.keys = sorted(self.model.state_dict())

    def post_fit(self) -> None:
        self.final = {k: full(v) for k, v in unwrapped(self.model).state_dict().items()}


class PipelinedFloat8Trainer(Float8Trainer):
    """The same GPT trained through ``forward_backward``, which runs it as pipeline stages;
    records every stage's layers and weights, not only this rank's."""

    training_step = StepAPITrainer.training_step  # its data and validation stay this GPT's

    def post_setup(self) -> None:
        super().post_setup()
        self.layer_types = merged(self.layer_types)
        self.weight_types = merged(self.weight_types)
        self.keys = sorted(merged(dict.fromkeys(self.keys)))

    def post_fit(self) -> None:
        super().post_fit()
        self.final = merged(self.final)


def merged(mine: dict[str, Any]) -> dict[str, Any]:
    """Every rank's ``mine``, merged by name (a collective)."""
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    return {name: value for rank in everyone for name, value in rank.items()}


class Loaded(Callback):
    """The full weights right after setup (after a resume's load), before any step."""

    def pre_fit(self) -> None:
        model = unwrapped(self.trainer.model)
        self.weights = {k: full(v) for k, v in model.state_dict().items()}


class Averages(Callback):
    """The full EMA averages at the end of the run."""

    def __init__(self, ema: EMA) -> None:
        self.ema = ema

    def post_fit(self) -> None:
        self.averages = {k: full(v) for k, v in self.ema.state_dict().items()
                         if isinstance(v, torch.Tensor)}


class Losses(Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def post_train_batch(self, result: dict[str, Any], batch_idx: int) -> None:
        self.losses.append(float(result["loss"].detach()))


def float8_config(params: DeviceParameters, dp: int, root: Path | None = None,
                  max_steps: int = STEPS, every_n_steps: int = STEPS, micro_batches: int = 1,
                  ranks_as_micro_batches: bool = False) -> Float8Config:
    """Each of ``dp`` data-parallel ranks reads its share of ``GLOBAL_BATCH`` samples a step
    in ``micro_batches`` accumulated micro-batches."""
    checkpoints = CheckpointParameters(root_dir=root, every_n_steps=every_n_steps,
                                       resume="latest") if root is not None \
        else CheckpointParameters(enabled=False)
    return Float8Config(project="float8", group="tests", experiment="gpt",
                        device_parameters=params, lr=0.1,
                        ranks_as_micro_batches=ranks_as_micro_batches,
                        training_parameters=TrainingParameters(
                            n_epochs=1, train_batch_size=GLOBAL_BATCH // dp // micro_batches,
                            gradient_accumulation_steps=micro_batches,
                            max_steps=max_steps),
                        checkpoint_parameters=checkpoints)


def train(config: Float8Config) -> dict[str, Any]:
    """Fit ``config``; return the recorded layer types, keys, losses and weights."""
    pipelined = config.device_parameters.pipeline_parallel > 1
    trainer = (PipelinedFloat8Trainer if pipelined else Float8Trainer)(config)
    loaded, losses, ema = Loaded(), Losses(), EMA(decay=0.5)
    averages = Averages(ema)
    for callback in (loaded, losses, ema, averages, Histograms(every_n_steps=STEPS)):
        trainer.callbacks.append(callback)
    trainer.callbacks.attach(trainer)
    trainer.fit()
    return {"layer_types": trainer.layer_types, "weight_types": trainer.weight_types,
            "keys": trainer.keys, "loaded": loaded.weights, "losses": losses.losses,
            "final": trainer.final, "global_step": trainer.global_step,
            "tp_styles": getattr(trainer, "tp_styles", None), "ema": averages.averages,
            "histograms": trainer.histograms}


def main(out: str, root: str, layout: str, *kill: str) -> None:
    if layout == "kill":
        # One process, checkpointed every 2 steps, SIGKILLed at the given points.
        trainer = Float8Trainer(float8_config(
            DeviceParameters.SINGLE_DEVICE(float8_recipe="tensorwise"), 1, Path(root),
            max_steps=2 * STEPS, every_n_steps=2))
        (Path(root) / "markers").mkdir(parents=True, exist_ok=True)
        trainer.callbacks.append(Killer(list(kill), Path(root) / "markers"))
        trainer.callbacks.attach(trainer)
        trainer.fit()
        torch.save(trainer.final, out)
        return
    if layout == "tp_fsdp":
        params = DeviceParameters(dp_shard=2, tensor_parallel=2, float8_recipe="tensorwise")
        results = {"tp_fsdp": train(float8_config(params, dp=2))}
    else:
        float8 = DeviceParameters.FSDP(float8_recipe="tensorwise")
        plain = DeviceParameters.FSDP()
        results = {
            # 4 float8 steps, checkpointed at step 4...
            "float8": train(float8_config(float8, 2, Path(root), STEPS)),
            # ...resumed without float8 for 2 more steps, checkpointed at step 6...
            "plain": train(float8_config(plain, 2, Path(root), STEPS + 2, 2)),
            # ...and resumed with float8 again.
            "back": train(float8_config(float8, 2, Path(root), STEPS + 4, 2)),
            # The same per-rank activation scales as "float8", with weights all-gathered in
            # float32 and cast on each rank.
            "ddp": train(float8_config(DeviceParameters.DDP(float8_recipe="tensorwise"), 2)),
            # Scales per row of activations and gradients: independent of the batch split.
            "rowwise_gw_hp": train(float8_config(
                DeviceParameters.FSDP(float8_recipe="rowwise_with_gw_hp"), 2)),
            # Two pipeline stages, each converted on its own, over two micro-batches.
            **{f"pp_{recipe}": train(float8_config(DeviceParameters(
                dp_replicate=1, pipeline_parallel=2, float8_recipe=recipe), 1))
               for recipe in ("tensorwise", "rowwise_with_gw_hp")},
        }
    save_on_rank_zero(results, out, "float8")


if __name__ == "__main__":
    main(*sys.argv[1:])
