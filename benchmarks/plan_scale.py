"""``dream-trainer plan`` at scale: a 1,024-rank 8B-shaped GPT planned on this CPU.

The model has Llama 3's shapes (RMSNorm, grouped-query attention, SwiGLU MLP, a 128,256-token
vocabulary, 8,192-token sequences) without rotary embeddings, which hold no parameters and
only a few activations: ``SHAPES["1b"]`` (1.24B parameters, output tied to the embedding),
``"8b"`` (8.03B) and ``"70b"`` (70.6B). Training is bf16 FSDP2 (float32 sharded weights,
gradients reduced in float32), AdamW, one sequence per rank and, by default, activation
checkpointing per block. The trainer's ``plan_batch()`` makes the batch, so no data is read.

The benchmark times ``dream-trainer plan benchmarks/plan_scale.py:make_trainer
--world-size 1024`` for the 8B shape with TP 8 x FSDP 128 (goal: under 60 s on this 2-core
machine) and reads the child's peak RSS; ``--quick`` plans a small shape instead, to check
the harness. ``--table`` prints the tables of docs/performance.md.

    python -m benchmarks.plan_scale [--quick]
    python -m benchmarks.plan_scale --table
    dream-trainer plan benchmarks/plan_scale.py:make_trainer --world-size 8,64,1024 \\
        --device-memory 80GiB -- --model 70b --device_parameters.tensor_parallel 8
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from benchmarks.processes import REPO_ROOT, child_env
from dream_trainer import BaseTrainer, BaseTrainerConfig
from dream_trainer.configs import DeviceParameters, TrainingParameters, apply_cli_overrides
from dream_trainer.mixins import SetupConfigMixin, SetupMixin

GOAL_SECONDS = 60.0


@dataclass(frozen=True)
class Shape:
    d_model: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    ffn: int
    vocab: int = 128256
    seq_len: int = 8192
    tied: bool = False

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads


SHAPES = {
    "tiny": Shape(d_model=256, n_layers=2, n_heads=8, n_kv_heads=8, ffn=512, vocab=1024,
                  seq_len=256),
    "1b": Shape(d_model=2048, n_layers=16, n_heads=32, n_kv_heads=8, ffn=8192, tied=True),
    "8b": Shape(d_model=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn=14336),
    "70b": Shape(d_model=8192, n_layers=80, n_heads=64, n_kv_heads=8, ffn=28672),
}


class Block(nn.Module):
    def __init__(self, shape: Shape) -> None:
        super().__init__()
        d, kv = shape.d_model, shape.n_kv_heads * shape.head_dim
        self.head_dim = shape.head_dim
        self.attn_norm = nn.RMSNorm(d)
        self.q = nn.Linear(d, d, bias=False)
        self.k = nn.Linear(d, kv, bias=False)
        self.v = nn.Linear(d, kv, bias=False)
        self.o = nn.Linear(d, d, bias=False)
        self.mlp_norm = nn.RMSNorm(d)
        self.gate = nn.Linear(d, shape.ffn, bias=False)
        self.up = nn.Linear(d, shape.ffn, bias=False)
        self.down = nn.Linear(shape.ffn, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        h = self.attn_norm(x)
        # Head counts come from the projections' widths: under TP each rank has its share.
        q, k, v = (proj(h).view(b, t, -1, self.head_dim).transpose(1, 2)
                   for proj in (self.q, self.k, self.v))
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        x = x + self.o(attended.transpose(1, 2).reshape(b, t, -1))
        h = self.mlp_norm(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


class GPT(nn.Module):
    def __init__(self, shape: Shape) -> None:
        super().__init__()
        self.embed = nn.Embedding(shape.vocab, shape.d_model)
        self.blocks = nn.ModuleList(Block(shape) for _ in range(shape.n_layers))
        self.norm = nn.RMSNorm(shape.d_model)
        self.head = nn.Linear(shape.d_model, shape.vocab, bias=False)
        if shape.tied:
            self.head.weight = self.embed.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Under a pipeline the modules other stages run are None.
        if self.embed is not None:
            x = self.embed(x)
        for block in self.blocks:
            if block is not None:
                x = block(x)
        if self.norm is not None:
            x = self.norm(x)
        return self.head(x) if self.head is not None else x


class ScaleConfig(BaseTrainerConfig, SetupConfigMixin):
    model: Literal["tiny", "1b", "8b", "70b"] = "8b"
    """Which shape of ``SHAPES`` to build."""


class ScaleTrainer(BaseTrainer, SetupMixin):
    config: ScaleConfig

    @property
    def shape(self) -> Shape:
        return SHAPES[self.config.model]

    def configure_models(self) -> None:
        self.model = GPT(self.shape)

    def apply_tensor_parallel(self, tp_mesh: DeviceMesh) -> None:
        from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                       parallelize_module)

        plan = {"q": ColwiseParallel(), "k": ColwiseParallel(), "v": ColwiseParallel(),
                "o": RowwiseParallel(), "gate": ColwiseParallel(), "up": ColwiseParallel(),
                "down": RowwiseParallel()}
        for block in self.model.blocks:
            if block is not None:
                parallelize_module(block, tp_mesh, plan)

    def configure_optimizers(self) -> None:
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=3e-4)

    def configure_dataloaders(self) -> tuple[list[Any], None]:
        # plan_batch() stands in for the data; a real run would return its loader here.
        return [self.plan_batch()], None

    def plan_batch(self) -> torch.Tensor:
        batch = self.config.training_parameters.train_batch_size
        return torch.randint(0, self.shape.vocab, (batch, self.shape.seq_len + 1))

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> dict[str, Any]:
        loss = self.forward_backward(self.model, batch[:, :-1], target=batch[:, 1:],
                                     loss_fn=next_token_loss)
        if not self.is_accumulating_gradients:
            self.step(self.model, self.optimizer)
        return {"loss": loss}

    def validation_step(self, batch: Any, batch_idx: int) -> dict[str, Any]:
        return {}


def next_token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def make_trainer(args: Sequence[str] | None = None) -> ScaleTrainer:
    config = ScaleConfig(
        project="bench", group="plan", experiment="scale",
        device_parameters=DeviceParameters(dp_replicate=1, dp_shard="auto",
                                           param_dtype="bf16", checkpoint_activations=True),
        training_parameters=TrainingParameters(n_epochs=1, train_batch_size=1))
    return ScaleTrainer(apply_cli_overrides(config, args))


def plan(world_sizes: Sequence[int], overrides: Sequence[str],
         ranks: Sequence[int] = ()) -> dict[str, Any]:
    """Run ``dream-trainer plan --json`` in a child; return its JSON objects, its wall time,
    CPU time (user + system: what the wall time would be on an idle machine, give or take
    the child's few threads) and peak RSS."""
    command = [sys.executable, "-m", "dream_trainer", "plan",
               "benchmarks/plan_scale.py:make_trainer",
               "--world-size", ",".join(map(str, world_sizes)), "--json"]
    if ranks:
        command += ["--rank", *map(str, ranks)]
    with tempfile.TemporaryFile("w+") as stdout, tempfile.TemporaryFile("w+") as stderr:
        start = time.perf_counter()
        child = subprocess.Popen([*command, "--", *overrides], cwd=REPO_ROOT, env=child_env(),
                                 stdout=stdout, stderr=stderr, text=True)
        # wait4 gives this child's own peak RSS (KiB on Linux), not the largest of all children.
        _, status, usage = os.wait4(child.pid, 0)
        seconds = time.perf_counter() - start
        child.returncode = os.waitstatus_to_exitcode(status)
        stdout.seek(0)
        stderr.seek(0)
        if child.returncode != 0:
            raise RuntimeError(f"{' '.join(command)} failed:\n{stderr.read()[-4000:]}")
        objects = [json.loads(line) for line in stdout.read().splitlines()]
    return {"objects": objects, "seconds": seconds,
            "cpu_seconds": usage.ru_utime + usage.ru_stime,
            "peak_rss_bytes": usage.ru_maxrss * 1024}


def measure(quick: bool) -> dict[str, Any]:
    """Plan the 8B shape (or the tiny one) at 1,024 ranks with TP 8 x FSDP 128."""
    model = "tiny" if quick else "8b"
    overrides = ["--model", model, "--device_parameters.tensor_parallel", "8"]
    run = plan([1024], overrides)
    (result,) = run["objects"]
    return {"model": model, "world_size": 1024, "mesh": result["mesh"],
            "ranks": sorted(map(int, result["ranks"])), "seconds": run["seconds"],
            "cpu_seconds": run["cpu_seconds"], "peak_rss_bytes": run["peak_rss_bytes"],
            "goal_seconds": GOAL_SECONDS, "meets_goal": run["seconds"] < GOAL_SECONDS,
            "per_rank": result["ranks"]}


def markdown(result: dict[str, Any]) -> list[str]:
    where = (f"`dream-trainer plan` of a {result['model']}-shaped GPT at {result['world_size']} "
             f"ranks ({' x '.join(f'{a}={d}' for a, d in result['mesh'].items())}, ranks "
             f"{' and '.join(map(str, result['ranks']))})")
    return [f"| {where}: wall time (CPU time) | {result['seconds']:.1f} s "
            f"({result['cpu_seconds']:.1f} s) |",
            f"| {where}: peak RSS | {result['peak_rss_bytes'] / 2**30:.2f} GiB |"]


LAYOUTS = {"FSDP": [], "FSDP x TP 8": ["--device_parameters.tensor_parallel", "8"],
           # Four sequences per data-parallel rank in four microbatches: the same global batch
           # (one sequence per GPU) as the other layouts.
           "PP 4 x FSDP": ["--device_parameters.pipeline_parallel", "4",
                           "--device_parameters.pipeline_schedule", "1F1B",
                           "--device_parameters.pipeline_microbatches", "4",
                           "--training_parameters.train_batch_size", "4",
                           "--training_parameters.val_batch_size", "4"]}
PIPELINED = {"PP 4 x FSDP"}


def tables(models: Sequence[str] = ("1b", "8b", "70b"), sizes: Sequence[int] = (8, 64, 1024),
           device_memory: str = "80GiB") -> str:
    """docs/performance.md's planning tables: rank 0 of each model, layout and world size
    (and the last rank, for a pipeline)."""
    from dream_trainer.planning.report import format_bytes, parse_size

    limit = parse_size(device_memory)
    lines = []
    for model in models:
        lines += [f"**{model}** ({device_memory} per GPU)", "",
                  "| GPUs | layout | mesh | params | grads | optimizer | activations | total "
                  "| fits | collectives per step (count, bytes) |",
                  "|---:|---|---|---:|---:|---:|---:|---:|---|---|"]
        for layout, overrides in LAYOUTS.items():
            if layout in PIPELINED and SHAPES[model].tied:
                continue  # a split refuses an output layer tied to the embedding
            # A pipeline's first and last stages differ: both are shown (plan's default).
            run = plan(sizes, ["--model", model, *overrides],
                       ranks=() if layout in PIPELINED else [0])
            rows = [(result, rank_id, rank) for result in run["objects"]
                    for rank_id, rank in result["ranks"].items()]
            for result, rank_id, rank in rows:
                where = f"{layout}, rank {rank_id}" if layout in PIPELINED else layout
                total = sum(rank[key] for key in ("param_bytes", "grad_bytes",
                                                  "optimizer_bytes", "activation_bytes"))
                fits = (f"yes ({format_bytes(limit - total)} spare)" if total <= limit
                        else f"no ({format_bytes(total - limit)} short)")
                comms = "; ".join(f"{axis}: {t['count']}, {format_bytes(t['bytes'])}"
                                  for axis, t in rank["collectives"].items())
                mesh = " x ".join(f"{a}={d}" for a, d in result["mesh"].items())
                lines.append(
                    f"| {result['world_size']} | {where} | {mesh} | "
                    + " | ".join(format_bytes(rank[key]) for key in (
                        "param_bytes", "grad_bytes", "optimizer_bytes", "activation_bytes"))
                    + f" | {format_bytes(total)} | {fits} | {comms} |")
        lines.append("")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a tiny shape: checks the harness")
    parser.add_argument("--table", action="store_true",
                        help="print docs/performance.md's planning tables instead")
    args = parser.parse_args()
    if args.table:
        print(tables())
        return
    result = measure(args.quick)
    print(json.dumps({k: v for k, v in result.items() if k != "per_rank"}, indent=2))
    print("\n".join(markdown(result)))


if __name__ == "__main__":
    main()
