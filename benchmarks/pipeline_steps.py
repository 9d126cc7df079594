"""Step time of a 2-stage pipeline against one process, on the CPU.

The same transformer (``LAYERS`` encoder blocks between an embedding and a head, following the
pipeline convention), data, seed and optimizer are trained through ``forward_backward`` by one
process and by ``pipeline_parallel=2`` under torchrun on 2 CPU ranks (1F1B, 4 microbatches
per batch). Each trial reports the median optimizer-step time of both after a warm-up; the
figures are the medians (and spread) of the per-trial ratio pipeline / one process, so machine
noise affects both alike. The largest difference between the two runs' final weights is
reported too (float rounding of the microbatched kernels, compounded over the steps; the
exact comparisons are tests/parallel/test_pipeline_parallel.py).

    python -m benchmarks.pipeline_steps [--steps 60] [--trials 3] [--json out.json]
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from benchmarks.step_timer import StepTimer
from benchmarks.two_rank_steps import compare
from benchmarks.two_rank_steps import main as two_rank_main
from dream_trainer import BaseTrainer, BaseTrainerConfig
from dream_trainer.configs import DeviceParameters, TrainingParameters
from dream_trainer.mixins import SetupConfigMixin, SetupMixin

VOCAB, WIDTH, SEQ, LAYERS, BATCH, MICROBATCHES = 256, 128, 64, 8, 16, 4


class PipelineLM(nn.Module):
    """Embedding, ``LAYERS`` encoder blocks, head; ``forward`` skips modules that are None."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleList(
            nn.TransformerEncoderLayer(WIDTH, 4, dim_feedforward=4 * WIDTH, dropout=0.0,
                                       batch_first=True) for _ in range(LAYERS))
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.embed is not None:
            x = self.embed(x)
        for block in self.blocks:
            if block is not None:
                x = block(x, is_causal=True, src_mask=_causal_mask(x.shape[1], x.device))
        return x if self.head is None else self.head(x)


def _causal_mask(length: int, device: torch.device) -> torch.Tensor:
    return nn.Transformer.generate_square_subsequent_mask(length, device=device)


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


class BenchConfig(BaseTrainerConfig, SetupConfigMixin):
    steps: int


class PipelineBench(StepTimer, BaseTrainer, SetupMixin):
    """Times each optimizer step (one micro-batch each) from batch start to its end."""

    config: BenchConfig

    def configure_models(self) -> None:
        self.model = PipelineLM()

    def configure_optimizers(self) -> None:
        # SGD: with Adam, float noise in near-zero gradients would become steps of ~lr and
        # hide whether the pipeline trains what one process does.
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.01)

    def configure_dataloaders(self) -> tuple[DataLoader[Any], None]:
        generator = torch.Generator().manual_seed(1)
        tokens = torch.randint(0, VOCAB, (self.config.steps * BATCH, SEQ + 1),
                               generator=generator)
        return DataLoader(TensorDataset(tokens), batch_size=BATCH), None

    def training_step(self, batch: Any, batch_idx: int) -> dict[str, Any]:
        (tokens,) = batch
        loss = self.forward_backward(self.model, tokens[:, :-1], target=tokens[:, 1:],
                                     loss_fn=lm_loss)
        return {"loss": loss, "grad_norm": self.step(self.model, self.optimizer)}

    def validation_step(self, batch: Any, batch_idx: int) -> dict[str, Any]:
        return {}

    def post_fit(self) -> None:
        super().post_fit()
        named = {name: param.detach().clone() for name, param in self.model.named_parameters()}
        everyone: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, named)
        self.final = {name: tensor for rank in everyone for name, tensor in rank.items()}


def run(pipeline: int, steps: int) -> tuple[float, dict[str, torch.Tensor]]:
    """Median step time and final weights of one run in this process (a rank of it)."""
    params = DeviceParameters(dp_replicate=1, pipeline_parallel=pipeline,
                              pipeline_microbatches=MICROBATCHES) if pipeline > 1 \
        else DeviceParameters.SINGLE_DEVICE()
    trainer = PipelineBench(BenchConfig(
        project="bench", group="pipeline", experiment=f"pp{pipeline}", seed=0, steps=steps,
        device_parameters=params,
        training_parameters=TrainingParameters(n_epochs=1, train_batch_size=BATCH)))
    trainer.times = []
    trainer.fit()
    return trainer.median_step(), trainer.final  # type: ignore[attr-defined]


def measure(steps: int = 60, trials: int = 3) -> dict[str, Any]:
    """Run the trials and summarize them."""
    compared = compare(lambda n: run(1, n), "benchmarks.pipeline_steps", steps, trials)
    return {
        "layers": LAYERS, "width": WIDTH, "seq_len": SEQ, "batch": BATCH,
        "microbatches": MICROBATCHES, "schedule": "1F1B", "steps": steps, "trials": trials,
        "median_step_seconds": {"one_process": compared["one_process"],
                                "pipeline_2": compared["two_ranks"]},
        "ratio_pipeline_to_one": compared["ratio"],
        "ratio_spread": compared["ratio_spread"],
        "max_weight_difference": compared["max_weight_difference"],
    }


def markdown(result: dict[str, Any]) -> list[str]:
    seconds = result["median_step_seconds"]
    low, high = result["ratio_spread"]
    return [
        f"| CPU step, one process ({result['layers']}-block transformer) | "
        f"{seconds['one_process'] * 1e3:.1f} ms |",
        f"| CPU step, pipeline_parallel=2 ({result['schedule']}, {result['microbatches']} "
        f"microbatches) / one process | {result['ratio_pipeline_to_one']:.3f} "
        f"({low:.3f}-{high:.3f}) |",
    ]


def main() -> None:
    two_rank_main(__doc__.splitlines()[0], measure, lambda steps: run(2, steps), 60)


if __name__ == "__main__":
    main()
