"""Step time of expert parallelism (ep=2 on 2 CPU ranks) against one process.

A small mixture-of-experts language model (an embedding, ``LAYERS`` residual blocks of a
linear mixing layer and a ``dream_trainer.nn.MoE`` with ``EXPERTS`` experts, top-2, and a
head) trains on the same tokens, seed and optimizer in one process (global batch ``BATCH``)
and with ``expert_parallel=2`` under torchrun on 2 CPU ranks (``BATCH / 2`` each: the same
global batch; each rank holds half of every layer's experts and exchanges tokens by
all-to-all). Each trial reports the median optimizer-step time of both after a warm-up; the
figures are the medians (and spread) of the per-trial ratio ep=2 / one process. On a 2-core
CPU this measures the cost of the exchange, not a speed-up: the point of expert parallelism
is memory (each rank holds ``1/ep`` of the experts) and, on GPUs, compute per expert. The
largest difference between the two runs' final weights is reported too (float rounding; the
exact comparisons are tests/nn/test_moe.py).

    python -m benchmarks.expert_steps [--steps 40] [--trials 3] [--json out.json]
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from benchmarks.step_timer import StepTimer
from benchmarks.two_rank_steps import compare
from benchmarks.two_rank_steps import main as two_rank_main
from dream_trainer import BaseTrainer, BaseTrainerConfig
from dream_trainer.configs import DeviceParameters, TrainingParameters
from dream_trainer.mixins import SetupConfigMixin, SetupMixin
from dream_trainer.nn import MoE

VOCAB, WIDTH, SEQ, LAYERS, EXPERTS, BATCH = 256, 128, 64, 4, 8, 16


class MoELM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.mixers = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS))
        self.experts = nn.ModuleList(MoE(WIDTH, 2 * WIDTH, EXPERTS, top_k=2,
                                         bias_update_rate=1e-3) for _ in range(LAYERS))
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for mixer, moe in zip(self.mixers, self.experts):
            x = x + torch.tanh(mixer(x))
            x = x + moe(x)
        return self.head(x)


class BenchConfig(BaseTrainerConfig, SetupConfigMixin):
    steps: int


class ExpertBench(StepTimer, BaseTrainer, SetupMixin):
    """Times each optimizer step (one micro-batch each) from batch start to its end."""

    config: BenchConfig

    def configure_models(self) -> None:
        self.model = MoELM()

    def configure_optimizers(self) -> None:
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.05)

    def configure_dataloaders(self) -> tuple[DataLoader[Any], None]:
        tokens = torch.randint(0, VOCAB, (self.config.steps * BATCH, SEQ + 1),
                               generator=torch.Generator().manual_seed(1))
        return DataLoader(TensorDataset(tokens),
                          batch_size=self.config.training_parameters.train_batch_size), None

    def training_step(self, batch: Any, batch_idx: int) -> dict[str, Any]:
        (tokens,) = batch
        logits = self.model(tokens[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
        self.backward(loss)
        return {"loss": loss, "grad_norm": self.step(self.model, self.optimizer)}

    def validation_step(self, batch: Any, batch_idx: int) -> dict[str, Any]:
        return {}

    def post_fit(self) -> None:
        super().post_fit()
        self.final = {name: (param.full_tensor() if hasattr(param, "full_tensor") else param)
                      .detach().clone() for name, param in self.model.named_parameters()}


def run(expert_parallel: int, steps: int) -> tuple[float, dict[str, torch.Tensor]]:
    """Median step time and final full weights of one run in this process (a rank of it)."""
    params = DeviceParameters(expert_parallel=expert_parallel) if expert_parallel > 1 \
        else DeviceParameters.SINGLE_DEVICE()
    trainer = ExpertBench(BenchConfig(
        project="bench", group="experts", experiment=f"ep{expert_parallel}", seed=0,
        steps=steps, device_parameters=params,
        training_parameters=TrainingParameters(n_epochs=1,
                                               train_batch_size=BATCH // expert_parallel)))
    trainer.times = []
    trainer.fit()
    return trainer.median_step(), trainer.final  # type: ignore[attr-defined]


def measure(steps: int = 40, trials: int = 3) -> dict[str, Any]:
    """Run the trials and summarize them."""
    compared = compare(lambda n: run(1, n), "benchmarks.expert_steps", steps, trials)
    return {
        "layers": LAYERS, "width": WIDTH, "experts": EXPERTS, "top_k": 2, "seq_len": SEQ,
        "global_batch": BATCH, "steps": steps, "trials": trials,
        "median_step_seconds": {"one_process": compared["one_process"],
                                "expert_parallel_2": compared["two_ranks"]},
        "ratio_ep2_to_one": compared["ratio"],
        "ratio_spread": compared["ratio_spread"],
        "max_weight_difference": compared["max_weight_difference"],
    }


def markdown(result: dict[str, Any]) -> list[str]:
    seconds = result["median_step_seconds"]
    low, high = result["ratio_spread"]
    return [
        f"| CPU step, one process ({result['layers']} MoE layers of {result['experts']} "
        f"experts, top-{result['top_k']}) | {seconds['one_process'] * 1e3:.1f} ms |",
        f"| CPU step, expert_parallel=2 on 2 ranks / one process (same global batch) | "
        f"{result['ratio_ep2_to_one']:.3f} ({low:.3f}-{high:.3f}) |",
    ]


def main() -> None:
    two_rank_main(__doc__.splitlines()[0], measure, lambda steps: run(2, steps), 40)


if __name__ == "__main__":
    main()
