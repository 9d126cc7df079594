"""Step time of mixture-of-experts training: expert parallelism (ep=2 on 2 CPU ranks) against
one process, grouped experts against the loop (bf16, CPU), and tokens/s and MFU on a GPU.

A small mixture-of-experts language model (an embedding, ``layers`` residual blocks of a
linear mixing layer and a ``dream_trainer.nn.MoE`` with ``experts`` experts, top-2, and a
head) trains with SGD on the same tokens and seed in every run.

- ep=2: one process (global batch ``batch``) and ``expert_parallel=2`` under torchrun on 2 CPU
  ranks (``batch / 2`` each; each rank holds half of every layer's experts and exchanges
  tokens by all-to-all). Each trial reports the median optimizer-step time of both after a
  warm-up; the figures are the medians (and spread) of the per-trial ratio. On a 2-core CPU
  this measures the cost of the exchange, not a speed-up. The largest difference between the
  two runs' final weights is reported too (float rounding; the exact comparisons are
  tests/nn/test_moe.py).
- grouped vs loop: one process, the model in bfloat16, its experts run as grouped matrix
  products (``grouped_mm``) or one after another (``GroupedExperts.use_grouped_mm=False``);
  trials alternate, the figure is the median of the per-trial ratio loop / grouped.
- ``--gpu``: a larger model in bfloat16 on one GPU: tokens/s and MFU (``6 x`` the active
  parameters per token, against the dense bf16 peak) with grouped experts, with the loop, and
  with each float8 recipe (torchao's float8 ``nn.Linear``: the mixing layers and the head; the
  router is filtered; on capability 9.0 and above the routed experts also run torchao's
  float8 grouped products, counted in ``float8_experts``).

    python -m benchmarks.expert_steps [--steps 40] [--trials 3] [--json out.json]
    python -m benchmarks.expert_steps --gpu [--steps 30] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from benchmarks.gpu_throughput import FLOAT8_RECIPES, peak_flops
from benchmarks.step_timer import StepTimer
from benchmarks.two_rank_steps import compare
from benchmarks.two_rank_steps import main as two_rank_main
from dream_trainer import BaseTrainer, BaseTrainerConfig
from dream_trainer.configs import DeviceParameters, TrainingParameters
from dream_trainer.configs.device import Float8Recipe
from dream_trainer.mixins import SetupConfigMixin, SetupMixin
from dream_trainer.nn import GroupedExperts, MoE, active_parameters


@dataclass(frozen=True)
class Shape:
    vocab: int = 256
    width: int = 128
    seq: int = 64
    layers: int = 4
    experts: int = 8
    batch: int = 16


CPU_SHAPE = Shape()
GPU_SHAPE = Shape(vocab=32768, width=1024, seq=2048, layers=8, experts=8, batch=8)


class MoELM(nn.Module):
    def __init__(self, shape: Shape) -> None:
        super().__init__()
        self.embed = nn.Embedding(shape.vocab, shape.width)
        self.mixers = nn.ModuleList(nn.Linear(shape.width, shape.width)
                                    for _ in range(shape.layers))
        self.experts = nn.ModuleList(MoE(shape.width, 2 * shape.width, shape.experts, top_k=2,
                                         bias_update_rate=1e-3) for _ in range(shape.layers))
        self.head = nn.Linear(shape.width, shape.vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for mixer, moe in zip(self.mixers, self.experts):
            x = x + torch.tanh(mixer(x))
            x = x + moe(x)
        return self.head(x)


class BenchConfig(BaseTrainerConfig, SetupConfigMixin):
    steps: int
    shape: Shape = CPU_SHAPE
    bf16: bool = False
    grouped: bool = True


class ExpertBench(StepTimer, BaseTrainer, SetupMixin):
    """Times each optimizer step (one micro-batch each) from batch start to its end (after a
    device synchronization on a GPU)."""

    config: BenchConfig

    def configure_models(self) -> None:
        self.model = MoELM(self.config.shape)
        for layer in self.model.experts:
            layer.experts.use_grouped_mm = self.config.grouped
        if self.config.bf16:
            self.model.to(torch.bfloat16)

    def configure_optimizers(self) -> None:
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.05)

    def configure_dataloaders(self) -> tuple[DataLoader[Any], None]:
        shape = self.config.shape
        tokens = torch.randint(0, shape.vocab, (self.config.steps * shape.batch, shape.seq + 1),
                               generator=torch.Generator().manual_seed(1))
        return DataLoader(TensorDataset(tokens),
                          batch_size=self.config.training_parameters.train_batch_size), None

    def training_step(self, batch: Any, batch_idx: int) -> dict[str, Any]:
        (tokens,) = batch
        logits = self.model(tokens[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
        self.backward(loss)
        return {"loss": loss, "grad_norm": self.step(self.model, self.optimizer)}

    def post_train_batch(self, result: dict[str, Any], batch_idx: int) -> None:
        if self.world.device.type == "cuda":  # the step's kernels, not only their launch
            torch.cuda.synchronize(self.world.device)
        super().post_train_batch(result, batch_idx)

    def validation_step(self, batch: Any, batch_idx: int) -> dict[str, Any]:
        return {}

    def post_fit(self) -> None:
        super().post_fit()
        self.final = {name: (param.full_tensor() if hasattr(param, "full_tensor") else param)
                      .detach().clone() for name, param in self.model.named_parameters()}


def train(steps: int, expert_parallel: int = 1, **fields: Any) -> ExpertBench:
    """One run in this process (a rank of it); ``fields`` are ``BenchConfig``'s."""
    params = DeviceParameters(expert_parallel=expert_parallel) if expert_parallel > 1 \
        else DeviceParameters.SINGLE_DEVICE(**fields.pop("device", {}))
    shape = fields.get("shape", CPU_SHAPE)
    trainer = ExpertBench(BenchConfig(
        project="bench", group="experts", experiment=f"ep{expert_parallel}", seed=0,
        steps=steps, device_parameters=params, **fields,
        training_parameters=TrainingParameters(n_epochs=1,
                                               train_batch_size=shape.batch // expert_parallel)))
    trainer.times = []
    trainer.fit()
    return trainer


def run(expert_parallel: int, steps: int) -> tuple[float, dict[str, torch.Tensor]]:
    """Median step time and final full weights of one float32 run (a rank of it)."""
    trainer = train(steps, expert_parallel)
    return trainer.median_step(), trainer.final  # type: ignore[attr-defined]


def grouped_vs_loop(steps: int, trials: int) -> dict[str, Any]:
    """bf16 in one process, trials alternating: median step times and loop / grouped."""
    grouped, looped, ratios, difference = [], [], [], 0.0
    for _ in range(trials):
        fast, slow = (train(steps, bf16=True, grouped=flag) for flag in (True, False))
        grouped.append(fast.median_step())
        looped.append(slow.median_step())
        ratios.append(looped[-1] / grouped[-1])
        difference = max(difference, max(float((fast.final[name].float()  # type: ignore
                                                - weight.float()).abs().max())
                                          for name, weight in slow.final.items()))  # type: ignore
    return {"grouped": statistics.median(grouped), "loop": statistics.median(looped),
            "ratio_loop_to_grouped": statistics.median(ratios),
            "ratio_spread": [min(ratios), max(ratios)], "max_weight_difference": difference}


def measure(steps: int = 40, trials: int = 3) -> dict[str, Any]:
    """Run the CPU trials (ep=2, then grouped vs loop) and summarize them."""
    compared = compare(lambda n: run(1, n), "benchmarks.expert_steps", steps, trials)
    return {
        "layers": CPU_SHAPE.layers, "width": CPU_SHAPE.width, "experts": CPU_SHAPE.experts,
        "top_k": 2, "seq_len": CPU_SHAPE.seq, "global_batch": CPU_SHAPE.batch, "steps": steps,
        "trials": trials,
        "median_step_seconds": {"one_process": compared["one_process"],
                                "expert_parallel_2": compared["two_ranks"]},
        "ratio_ep2_to_one": compared["ratio"],
        "ratio_spread": compared["ratio_spread"],
        "max_weight_difference": compared["max_weight_difference"],
        "bf16_grouped_vs_loop": grouped_vs_loop(steps, trials),
    }


def measure_gpu(steps: int = 30, shape: Shape = GPU_SHAPE,
                float8_recipes: tuple[Float8Recipe, ...] = FLOAT8_RECIPES,
                device: str = "cuda") -> dict[str, Any]:
    """Tokens/s and MFU in bfloat16 on ``device``: grouped experts, the loop, and grouped
    experts with each float8 recipe (``device="cpu"`` checks the code, measuring nothing)."""
    variants: dict[str, dict[str, Any]] = {
        "grouped": {}, "loop": {"grouped": False},
        **{f"grouped_float8_{recipe}": {"float8_recipe": recipe} for recipe in float8_recipes},
    }
    name = torch.cuda.get_device_name() if device == "cuda" else device
    peak = peak_flops(name)
    result: dict[str, Any] = {"device": name, "torch": torch.__version__, "shape": asdict(shape),
                              "steps": steps, "peak_flops": peak}
    for variant, options in variants.items():
        recipe = options.get("float8_recipe")
        trainer = train(steps, shape=shape, bf16=True, grouped=options.get("grouped", True),
                        device={"device": device, "float8_recipe": recipe})
        active = active_parameters(trainer.model)
        tokens_per_second = shape.batch * shape.seq / trainer.median_step()
        result[variant] = {
            "tokens_per_second": tokens_per_second, "active_parameters": active,
            "mfu": None if peak is None else 6 * active * tokens_per_second / peak,
            "float8_layers": sum(type(module).__name__ == "Float8Linear"
                                 for module in trainer.model.modules()),
            "float8_experts": sum(type(module.w1.data).__module__.startswith("torchao")
                                  for module in trainer.model.modules()
                                  if isinstance(module, GroupedExperts))}
        print(f"{variant}: {tokens_per_second:,.0f} tokens/s", file=sys.stderr, flush=True)
    return result


def markdown(result: dict[str, Any]) -> list[str]:
    seconds = result["median_step_seconds"]
    low, high = result["ratio_spread"]
    rows = [
        f"| CPU step, one process ({result['layers']} MoE layers of {result['experts']} "
        f"experts, top-{result['top_k']}) | {seconds['one_process'] * 1e3:.1f} ms |",
        f"| CPU step, expert_parallel=2 on 2 ranks / one process (same global batch) | "
        f"{result['ratio_ep2_to_one']:.3f} ({low:.3f}-{high:.3f}) |",
    ]
    grouped = result.get("bf16_grouped_vs_loop")  # absent from results recorded before it
    if grouped is not None:
        low, high = grouped["ratio_spread"]
        rows.append(f"| CPU bf16 step, experts in a loop / grouped_mm (one process) | "
                    f"{grouped['loop'] * 1e3:.1f} / {grouped['grouped'] * 1e3:.1f} ms = "
                    f"{grouped['ratio_loop_to_grouped']:.3f} ({low:.3f}-{high:.3f}) |")
    return rows


def gpu_main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpu", action="store_true", required=True)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--batch", type=int, default=GPU_SHAPE.batch)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    result = measure_gpu(args.steps, replace(GPU_SHAPE, batch=args.batch))
    print(json.dumps(result, indent=2))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))


def main() -> None:
    if "--gpu" in sys.argv:
        gpu_main()
    else:
        two_rank_main(__doc__.splitlines()[0], measure, lambda steps: run(2, steps), 40)


if __name__ == "__main__":
    main()
