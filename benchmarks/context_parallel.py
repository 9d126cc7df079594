"""Activation memory and step time of context parallelism (cp=2) against one process.

A causal GPT with rotary positions (``RotaryGPT``: SDPA attention with ``is_causal=True``,
one rotary table named in ``context_parallel_buffers()``) trains on one long sequence per
step, through ``forward_backward``, with SGD: once in one process and once with
``context_parallel=2`` on 2 ranks (each holding a head and a tail quarter of the sequence,
keys and values all-gathered), on the same tokens, seed and optimizer. Each trial reports
for every rank:

- activation memory: the bytes of the tensors autograd saves for backward during the first
  step's forward (``torch.autograd.graph.saved_tensors_hooks``), each storage counted once
  and parameters left out; that is what a rank keeps alive from forward to backward, the
  memory context parallelism exists to split. It is broken down into attention masks
  (``[local, whole]`` positions), gathered keys and values (4-D, the whole sequence along
  dim -2) and per-token tensors (the rest);
- the median optimizer-step time after a warm-up (``StepTimer``).

The step-time figure is the median (and spread) over the trials of the ratio cp=2 / one
process; the memory figures are exact, the same in every trial. The largest difference
between the two runs' final weights shows that both trained the same model.

``--gpu`` runs the same code on CUDA (nccl, bfloat16): tokens/s at cp=1 on one GPU, and at
cp=2 (4, 8) on as many GPUs when there are (every layout trains the same global batch, so
its tokens/s is the job's); with one GPU only cp=1 runs, and the result says so.

    python -m benchmarks.context_parallel [--seq-len 4096] [--steps 12] [--trials 2]
        [--gpu] [--json out.json]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.autograd.graph import saved_tensors_hooks
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader, TensorDataset

from benchmarks.processes import child_env
from benchmarks.step_timer import WARMUP, StepTimer
from dream_trainer import BaseTrainer, BaseTrainerConfig
from dream_trainer.configs import DeviceParameters, TrainingParameters
from dream_trainer.mixins import SetupConfigMixin, SetupMixin

CATEGORIES = ("attention_masks", "gathered_keys_values", "per_token")


@dataclass(frozen=True)
class Shape:
    vocab: int = 2048
    width: int = 64
    heads: int = 2
    layers: int = 4
    seq_len: int = 4096
    batch: int = 1


# The vocabulary is 32 times the width, as in Llama 3 (128,256 over 4,096): the logits are a
# share of the activations that context parallelism splits, as in the models it is for.
CPU_SHAPE = Shape()
QUICK_SHAPE = Shape(vocab=64, width=16, heads=2, layers=2, seq_len=64, batch=2)
GPU_DEGREES = (2, 4, 8)
"""The context-parallel degrees ``--gpu`` runs beside cp=1, those the GPUs present allow."""
GPU_SHAPE = Shape(vocab=32768, width=1024, heads=8, layers=8, seq_len=16384)


class Rotary(nn.Module):
    """The rotation angle of each position and frequency: ``angles[p, i]``."""

    def __init__(self, head_dim: int, max_len: int) -> None:
        super().__init__()
        self.head_dim, self.max_len = head_dim, max_len
        self.register_buffer("angles", torch.empty(max_len, head_dim // 2), persistent=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Compute the table (setup builds models on the meta device, then calls this)."""
        inverse = 1.0 / 10000 ** (torch.arange(0, self.head_dim, 2).float() / self.head_dim)
        angles = torch.outer(torch.arange(self.max_len).float(), inverse)
        self.angles = angles.to(self.angles.device)

    def forward(self, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The cosines and sines of the first ``length`` rows (under context parallelism the
        table holds this rank's positions only, so these are all of them)."""
        angles = self.angles[:length]
        return angles.cos(), angles.sin()


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # In x's dtype: a float32 table would promote bfloat16 queries and keys past the values.
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.stack((even * cos - odd * sin, even * sin + odd * cos), -1).flatten(-2)


class Block(nn.Module):
    def __init__(self, shape: Shape) -> None:
        super().__init__()
        self.heads = shape.heads
        self.attn_norm = nn.LayerNorm(shape.width, bias=False)
        self.qkv = nn.Linear(shape.width, 3 * shape.width, bias=False)
        self.proj = nn.Linear(shape.width, shape.width, bias=False)
        self.mlp_norm = nn.LayerNorm(shape.width, bias=False)
        self.up = nn.Linear(shape.width, 4 * shape.width, bias=False)
        self.down = nn.Linear(4 * shape.width, shape.width, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = (self.qkv(self.attn_norm(x)).view(b, t, 3, self.heads, d // self.heads)
                   .permute(2, 0, 3, 1, 4))
        attended = F.scaled_dot_product_attention(rotate(q, cos, sin), rotate(k, cos, sin), v,
                                                  is_causal=True)
        x = x + self.proj(attended.transpose(1, 2).reshape(b, t, d))
        return x + self.down(F.gelu(self.up(self.mlp_norm(x)), approximate="tanh"))


class RotaryGPT(nn.Module):
    def __init__(self, shape: Shape) -> None:
        super().__init__()
        self.embed = nn.Embedding(shape.vocab, shape.width)
        self.rope = Rotary(shape.width // shape.heads, shape.seq_len)
        self.blocks = nn.ModuleList(Block(shape) for _ in range(shape.layers))
        self.norm = nn.LayerNorm(shape.width, bias=False)
        self.head = nn.Linear(shape.width, shape.vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        cos, sin = self.rope(tokens.size(1))
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x, cos, sin)
        return self.head(self.norm(x))


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


class SavedTensors:
    """Counts the bytes autograd saves for backward inside ``watch()``: each storage once,
    parameters (and views of them: FSDP2's unsharded ones too) left out, by ``CATEGORIES``.

    Args:
        seq_len: The whole sequence's length.
        local_len: The positions this rank holds (``seq_len / cp``).
    """

    def __init__(self, seq_len: int, local_len: int) -> None:
        self.seq_len, self.local_len = seq_len, local_len
        self.bytes = dict.fromkeys(CATEGORIES, 0)
        self._seen: set[int] = set()

    @contextlib.contextmanager
    def watch(self) -> Iterator[None]:
        with saved_tensors_hooks(self._pack, lambda tensor: tensor):
            yield

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        base = tensor if tensor._base is None else tensor._base
        storage = tensor.untyped_storage()
        if not isinstance(base, nn.Parameter) and storage.data_ptr() not in self._seen:
            self._seen.add(storage.data_ptr())
            self.bytes[self._category(tensor)] += storage.nbytes()
        return tensor

    def _category(self, tensor: torch.Tensor) -> str:
        if self.local_len == self.seq_len:  # one process: nothing is gathered or masked
            return "per_token"
        if tensor.shape[-2:] == (self.local_len, self.seq_len):
            return "attention_masks"
        if tensor.dim() == 4 and tensor.size(-2) == self.seq_len:
            return "gathered_keys_values"
        return "per_token"


class BenchConfig(BaseTrainerConfig, SetupConfigMixin):
    shape: dict[str, int]
    steps: int


class ContextBench(StepTimer, BaseTrainer, SetupMixin):
    """Times each optimizer step (synchronizing CUDA first); counts the first step's saved
    tensors; gathers the final weights as full tensors."""

    config: BenchConfig

    def __init__(self, config: BenchConfig) -> None:
        super().__init__(config)
        self.shape = Shape(**config.shape)
        cp = config.device_parameters.context_parallel
        assert isinstance(cp, int)
        self.times = []
        self.saved = SavedTensors(self.shape.seq_len, self.shape.seq_len // cp)
        self.ranks: list[dict[str, Any]] = []
        self.final: dict[str, torch.Tensor] = {}

    def configure_models(self) -> None:
        self.model = RotaryGPT(self.shape)

    def context_parallel_buffers(self) -> dict[str, int]:
        return {"model.rope.angles": 0}

    def configure_optimizers(self) -> None:
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.05)

    def configure_dataloaders(self) -> tuple[DataLoader[Any], None]:
        shape = self.shape
        tokens = torch.randint(0, shape.vocab, (self.config.steps * shape.batch,
                                                shape.seq_len + 1),
                               generator=torch.Generator().manual_seed(1))
        return DataLoader(TensorDataset(tokens), batch_size=shape.batch), None

    def pre_train_batch(self, batch: Any, batch_idx: int) -> None:
        _synchronize(self.world.device)
        super().pre_train_batch(batch, batch_idx)

    def post_train_batch(self, result: dict[str, Any], batch_idx: int) -> None:
        _synchronize(self.world.device)
        super().post_train_batch(result, batch_idx)

    def training_step(self, batch: Any, batch_idx: int) -> dict[str, Any]:
        (tokens,) = batch
        # The first step is a warm-up step left out of the timing: counting costs it a little.
        with self.saved.watch() if batch_idx == 0 else contextlib.nullcontext():
            loss = self.forward_backward(self.model, tokens[:, :-1], target=tokens[:, 1:],
                                         loss_fn=lm_loss)
        return {"loss": loss, "grad_norm": self.step(self.model, self.optimizer)}

    def validation_step(self, batch: Any, batch_idx: int) -> dict[str, Any]:
        return {}

    def post_fit(self) -> None:
        super().post_fit()
        self.final = {name: (param.full_tensor() if isinstance(param, DTensor) else param)
                      .detach().float().cpu() for name, param in self.model.named_parameters()}
        mine = {"median_step_seconds": self.median_step(),
                "activation_bytes": dict(self.saved.bytes)}
        self.ranks = [mine] * dist.get_world_size()
        dist.all_gather_object(self.ranks, mine)


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run(cp: int, shape: Shape, steps: int, device: str = "cpu") -> dict[str, Any]:
    """One run of ``cp`` ranks, this process one of them: every rank's median step seconds
    and saved bytes by category, and the final weights."""
    precision = {"param_dtype": torch.bfloat16} if device == "cuda" else {}
    params = DeviceParameters(device=device, dp_replicate=1, context_parallel=cp, **precision)
    trainer = ContextBench(BenchConfig(
        project="bench", group="context_parallel", experiment=f"cp{cp}", seed=0,
        shape=asdict(shape), steps=steps, device_parameters=params,
        training_parameters=TrainingParameters(n_epochs=1, train_batch_size=shape.batch)))
    trainer.fit()
    return {"ranks": trainer.ranks, "weights": trainer.final}


def launch(cp: int, shape: Shape, steps: int, device: str) -> dict[str, Any]:
    """``run`` on ``cp`` ranks under torchrun; what its rank 0 returned."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "run.pt"
        command = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={cp}",
                   "--standalone", "-m", "benchmarks.context_parallel", "--worker", str(out),
                   "--cp", str(cp), "--steps", str(steps), "--device", device,
                   "--shape", json.dumps(asdict(shape))]
        result = subprocess.run(command, env=child_env(), capture_output=True, text=True,
                                timeout=1200)
        if result.returncode != 0:
            raise RuntimeError(f"the cp={cp} run failed:\n{result.stderr[-3000:]}")
        return torch.load(out)


def summary(runs: list[dict[str, Any]], shape: Shape) -> dict[str, Any]:
    """One layout's trials: the median of the slowest rank's median step, tokens/s of the
    job, and the largest rank's saved bytes (the same in every trial: the first's)."""
    seconds = statistics.median(max(rank["median_step_seconds"] for rank in run["ranks"])
                                for run in runs)
    largest = max(runs[0]["ranks"], key=lambda rank: sum(rank["activation_bytes"].values()))
    return {"median_step_seconds": seconds,
            "tokens_per_second": shape.batch * shape.seq_len / seconds,
            "activation_bytes": sum(largest["activation_bytes"].values()),
            "activation_bytes_by_category": largest["activation_bytes"],
            "ranks": [run["ranks"] for run in runs]}


def measure(shape: Shape = CPU_SHAPE, steps: int = 12, trials: int = 2) -> dict[str, Any]:
    """On the CPU, ``trials`` times: one process, then cp=2 on 2 ranks; the ratios
    cp=2 / one process of activation memory per rank and of step time."""
    ones, twos = [], []
    for _ in range(trials):
        ones.append(run(1, shape, steps))
        twos.append(launch(2, shape, steps, "cpu"))
    one, two = summary(ones, shape), summary(twos, shape)
    ratios = [max(r["median_step_seconds"] for r in b["ranks"])
              / a["ranks"][0]["median_step_seconds"] for a, b in zip(ones, twos)]
    return {
        "device": "cpu", "shape": asdict(shape), "steps": steps, "warmup": WARMUP,
        "trials": trials, "cp1": one, "cp2": two,
        "activation_ratio_cp2_to_cp1": two["activation_bytes"] / one["activation_bytes"],
        "step_time_ratio_cp2_to_cp1": statistics.median(ratios),
        "step_time_ratio_spread": [min(ratios), max(ratios)],
        "max_weight_difference": max(
            float((b["weights"][name] - tensor).abs().max())
            for a, b in zip(ones, twos) for name, tensor in a["weights"].items()),
    }


def measure_gpu(shape: Shape = GPU_SHAPE, steps: int = 20, trials: int = 2) -> dict[str, Any]:
    """On CUDA: tokens/s and saved bytes at cp=1 on one GPU and at cp=2, 4 and 8 on as many
    as there are (cp=2 left out, and said, with one). Each layout runs under torchrun, so no
    run inherits another's allocator state."""
    gpus = torch.cuda.device_count()
    layouts = [1, *(cp for cp in GPU_DEGREES if cp <= gpus)]
    result: dict[str, Any] = {
        "device": torch.cuda.get_device_name(0), "gpus": gpus, "shape": asdict(shape),
        "steps": steps, "warmup": WARMUP, "trials": trials, "param_dtype": "bfloat16",
        "cp2_left_out": None if gpus >= 2 else f"cp=2 needs 2 GPUs; {gpus} present",
    }
    for cp in layouts:
        runs = [launch(cp, shape, steps, "cuda") for _ in range(trials)]
        result[f"cp{cp}"] = summary(runs, shape)
    for cp in layouts[1:]:
        result[f"tokens_per_second_ratio_cp{cp}_to_cp1"] = (
            result[f"cp{cp}"]["tokens_per_second"] / result["cp1"]["tokens_per_second"])
        result[f"activation_ratio_cp{cp}_to_cp1"] = (result[f"cp{cp}"]["activation_bytes"]
                                                     / result["cp1"]["activation_bytes"])
    return result


def markdown(result: dict[str, Any]) -> list[str]:
    shape = result["shape"]
    model = (f"{shape['layers']}-block causal GPT, width {shape['width']}, "
             f"{shape['seq_len']:,} tokens")
    if result["device"] != "cpu":
        rows = [f"| GPU ({result['device']}), cp={cp} ({model}) | "
                f"{result[f'cp{cp}']['tokens_per_second']:,.0f} tokens/s |"
                for cp in (1, *GPU_DEGREES) if f"cp{cp}" in result]
        return rows + ([f"| GPU, cp=2 | left out: {result['cp2_left_out']} |"]
                       if result["cp2_left_out"] else [])
    low, high = result["step_time_ratio_spread"]
    return [
        f"| CPU activation memory per rank, cp=1 ({model}) | "
        f"{result['cp1']['activation_bytes'] / 2**20:.1f} MiB |",
        f"| CPU activation memory per rank, cp=2 / cp=1 | "
        f"{result['activation_ratio_cp2_to_cp1']:.3f} |",
        f"| CPU step time per rank, cp=2 / cp=1 | {result['step_time_ratio_cp2_to_cp1']:.3f} "
        f"({low:.3f}-{high:.3f}) |",
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int)
    parser.add_argument("--trials", type=int, default=2)
    parser.add_argument("--seq-len", type=int, help="the sequence length (else the shape's)")
    parser.add_argument("--gpu", action="store_true", help="tokens/s on CUDA")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--cp", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--device", help=argparse.SUPPRESS)
    parser.add_argument("--shape", type=json.loads, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker is not None:
        ran = run(args.cp, Shape(**args.shape), args.steps, args.device)
        if int(os.environ.get("RANK", "0")) == 0:
            torch.save(ran, args.worker)
        return
    shape = GPU_SHAPE if args.gpu else CPU_SHAPE
    if args.seq_len is not None:
        shape = Shape(**{**asdict(shape), "seq_len": args.seq_len})
    if args.gpu:
        if not torch.cuda.is_available():
            raise SystemExit("--gpu needs a CUDA GPU")
        result = measure_gpu(shape, args.steps or 20, args.trials)
    else:
        result = measure(shape, args.steps or 12, args.trials)
    print(json.dumps(result, indent=2))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
