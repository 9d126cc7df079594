"""Tokens/s and MFU of a GPT-style model on one GPU: a hand-written loop vs ``DreamTrainer``.

Both train the same ~0.9B-parameter decoder (``benchmarks.gpt``) with float32 master weights,
bfloat16 autocast, each block compiled with ``torch.compile``, fused AdamW and gradient
clipping at 1.0, on the same pre-generated token batches already on the GPU (so the data
path is not measured). ``DreamTrainer`` runs with its default callbacks and JSON logging, and
once with no callbacks; no checkpoint is written inside the timed steps (fit's final one is
deleted after each run). Trials alternate between the variants so drift affects all alike.
``DreamTrainer`` also runs with each ``--float8`` recipe (torchao's float8 linear layers,
``DeviceParameters.float8_recipe``); their MFU is counted against the same bfloat16 peak, as
torchtitan and Megatron report it, so it compares directly with the bfloat16 rows.

    python -m benchmarks.gpu_throughput [--steps 30] [--warmup 10] [--trials 2]
        [--float8 tensorwise rowwise] [--json out.json]
    python -m benchmarks.gpu_throughput --model llama3-8b-widths --batch-size 1 \
        --activation-checkpointing full

``--model llama3-8b-widths`` trains Llama 3 8B's widths (d_model 4,096, SwiGLU 14,336, 32
heads, 8 key/value heads, a 128K vocabulary) with as many layers as ``dream-trainer plan``
says fit 90 % of the GPU under the chosen activation checkpointing (``layers_that_fit``), for
the float8 gain at the widths torchtitan reports it for. Every run also records the plan's
total for its bfloat16 ``DreamTrainer`` variant (``planned_gib``) beside the measured peak.

``measure(..., device=torch.device("cpu"), compile=False)`` runs the same code on the CPU
(emulated float8, meaningless figures) so that the suite keeps it working without a GPU.
"""

from __future__ import annotations

import argparse
import gc
import json
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from functools import partial
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any, get_args

import torch

from benchmarks.gpt import GPT, LLAMA3_8B_WIDTHS, GPTShape, init_gpt, lm_loss
from dream_trainer import DreamTrainer, DreamTrainerConfig
from dream_trainer.callbacks import CallbackCollection
from dream_trainer.configs import (CheckpointParameters, DeviceParameters, LoggingParameters,
                                   TrainingParameters)
from dream_trainer.configs.activation_policy import CheckpointingPolicy
from dream_trainer.configs.device import Float8Recipe
from dream_trainer.parallel.checkpointing import checkpoint_blocks
from dream_trainer.utils.memory import CudaPeakWindow

SEED, LR, CLIP = 0, 3e-4, 1.0
FLOAT8_RECIPES = ("tensorwise", "rowwise")
# Dense bfloat16 peak of the SXM parts (NVIDIA's datasheets; H200 has the H100's compute).
PEAK_BF16_FLOPS = {"H100": 989.4e12, "H200": 989.4e12, "A100": 312e12}


def peak_flops(device_name: str) -> float | None:
    return next((flops for key, flops in PEAK_BF16_FLOPS.items() if key in device_name), None)


def make_batches(shape: GPTShape, batch_size: int, n: int,
                 device: torch.device) -> list[tuple[torch.Tensor, ...]]:
    generator = torch.Generator(device=device).manual_seed(1)
    tokens = torch.randint(0, shape.vocab, (n, batch_size, shape.seq_len + 1), device=device,
                           generator=generator)
    return [(t[:, :-1], t[:, 1:]) for t in tokens]


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def compile_blocks(model: GPT) -> None:
    for index, block in enumerate(model.blocks):
        model.blocks[index] = torch.compile(block)


def fresh_memory_stats(device: torch.device) -> CudaPeakWindow | None:
    """Free what the previous run left (trainers hold reference cycles), then open a window on
    the allocator's peak. A window, not ``max_memory_allocated``: the default callbacks read
    their own windows and so reset the device's peak counter as they go; the windows fold each
    reset into one another, so this one still sees the whole run's peak."""
    gc.collect()
    if device.type != "cuda":
        return None
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    return CudaPeakWindow(device)


def peak_memory_gib(window: CudaPeakWindow | None) -> float | None:
    return None if window is None else window.peek()[0] / 2**30


def hand_written(shape: GPTShape, batches: list[Any], warmup: int, device: torch.device,
                 compile: bool,
                 activation_checkpointing: CheckpointingPolicy = None) -> dict[str, Any]:
    window = fresh_memory_stats(device)
    torch.manual_seed(SEED)
    model = GPT(shape).to(device)
    init_gpt(model)
    if activation_checkpointing is not None:  # the same wrapping DreamTrainer's part applies
        checkpoint_blocks(model, activation_checkpointing)
    if compile:
        compile_blocks(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, fused=True)
    start = 0.0
    for index, (tokens, targets) in enumerate(batches):
        if index == warmup:
            synchronize(device)
            start = time.perf_counter()
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = lm_loss(model(tokens), targets)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP, foreach=True)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    synchronize(device)
    seconds = time.perf_counter() - start
    n_params = sum(p.numel() for p in model.parameters())
    return {"seconds": seconds, "final_loss": loss.item(), "n_params": n_params,
            "peak_memory_gib": peak_memory_gib(window)}


class BenchConfig(DreamTrainerConfig):
    warmup: int


class GPTBench(DreamTrainer):
    config: BenchConfig

    def __init__(self, config: BenchConfig, shape: GPTShape, batches: list[Any]) -> None:
        super().__init__(config)
        self.shape, self.batches = shape, batches
        self.start = self.end = 0.0
        self.last_loss: torch.Tensor | None = None

    def configure_models(self) -> None:
        self.model = GPT(self.shape)

    def init_weights(self) -> None:
        init_gpt(self.model)

    def configure_optimizers(self) -> None:
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=LR, fused=True)

    def configure_dataloaders(self) -> tuple[list[Any], None]:
        return self.batches, None

    def plan_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """One micro-batch for ``dream-trainer plan`` (made on fake tensors there)."""
        batch = self.config.training_parameters.train_batch_size
        tokens = torch.zeros(batch, self.shape.seq_len + 1, dtype=torch.long)
        return tokens[:, :-1], tokens[:, 1:]

    def training_step(self, batch: Any, batch_idx: int) -> dict[str, Any]:
        if batch_idx == self.config.warmup:
            synchronize(self.world.device)
            self.start = time.perf_counter()
        tokens, targets = batch
        loss = lm_loss(self.model(tokens), targets)
        self.backward(loss)
        grad_norm = self.step(self.model, self.optimizer)
        self.last_loss = loss.detach()
        return {"loss": loss, "grad_norm": grad_norm}

    def post_train_batch(self, result: dict[str, Any], batch_idx: int) -> None:
        super().post_train_batch(result, batch_idx)
        if batch_idx == len(self.batches) - 1:  # stop the clock before fit()'s teardown
            synchronize(self.world.device)
            self.end = time.perf_counter()

    def validation_step(self, batch: Any, batch_idx: int) -> dict[str, Any]:
        return {}


def bench_config(workdir: Path, warmup: int, batch_size: int, compile: bool,
                 default_callbacks: bool = True, float8_recipe: Float8Recipe | None = None,
                 activation_checkpointing: CheckpointingPolicy = None) -> BenchConfig:
    extra = {} if default_callbacks else {"callbacks": CallbackCollection()}
    return BenchConfig(**extra,
        project="bench", group="gpu", experiment="gpt", seed=SEED, warmup=warmup,
        device_parameters=DeviceParameters(param_dtype=torch.bfloat16, compile_model=compile,
                                           float8_recipe=float8_recipe,
                                           activation_checkpointing=activation_checkpointing),
        training_parameters=TrainingParameters(n_epochs=1, train_batch_size=batch_size,
                                               gradient_clip_val=CLIP),
        checkpoint_parameters=CheckpointParameters(root_dir=workdir, every_n_epochs=None),
        logging_parameters=LoggingParameters(log_dir=workdir))


def dream(shape: GPTShape, batches: list[Any], warmup: int, batch_size: int,
          workdir: Path, device: torch.device, compile: bool, default_callbacks: bool = True,
          float8_recipe: Float8Recipe | None = None,
          activation_checkpointing: CheckpointingPolicy = None) -> dict[str, Any]:
    config = bench_config(workdir, warmup, batch_size, compile, default_callbacks,
                          float8_recipe, activation_checkpointing)
    trainer = GPTBench(config, shape, batches)
    window = fresh_memory_stats(device)
    trainer.fit()
    shutil.rmtree(workdir)  # fit() always ends with a checkpoint: ~12 GB at this size
    assert trainer.last_loss is not None
    float8_layers = sum(type(module).__name__ == "Float8Linear"
                        for module in trainer.model.modules())
    return {"seconds": trainer.end - trainer.start, "final_loss": trainer.last_loss.item(),
            "peak_memory_gib": peak_memory_gib(window), "float8_layers": float8_layers}


def planned_bytes(shape: GPTShape, batch_size: int,
                  activation_checkpointing: CheckpointingPolicy = None,
                  float8_recipe: Float8Recipe | None = None) -> int:
    """``dream-trainer plan``'s total for one GPU of the ``dream`` variant at this shape:
    parameters, gradients, AdamW state and the step's activation peak, from one step on fake
    tensors (the CUDA context, kernels' workspaces and fragmentation are not in it)."""
    from dream_trainer.planning.simulate import plan_rank

    with tempfile.TemporaryDirectory() as tmp:
        config = bench_config(Path(tmp), 0, batch_size, compile=False,
                              default_callbacks=False, float8_recipe=float8_recipe,
                              activation_checkpointing=activation_checkpointing)
        placeholder = [(torch.zeros(batch_size, shape.seq_len, dtype=torch.long),) * 2]
        return plan_rank(lambda: GPTBench(config, shape, placeholder), 1, 0, 1).total_bytes


def layers_that_fit(shape: GPTShape, batch_size: int, memory_bytes: int,
                    activation_checkpointing: CheckpointingPolicy = None,
                    float8_recipe: Float8Recipe | None = None) -> int:
    """The most layers, up to ``shape.n_layers``, whose planned total fits ``memory_bytes``
    (a bisection over ``planned_bytes``, which grows with the layers).

    Raises:
        ValueError: if one layer does not fit.
    """
    def fits(layers: int) -> bool:
        return planned_bytes(replace(shape, n_layers=layers), batch_size,
                             activation_checkpointing, float8_recipe) <= memory_bytes

    if not fits(1):
        raise ValueError(f"one layer of {shape} with micro-batches of {batch_size} does not fit "
                         f"{memory_bytes / 2**30:.1f} GiB: lower --batch-size or --seq-len, or "
                         "checkpoint activations")
    low, high = 1, shape.n_layers  # low fits; the answer is in [low, high]
    while low < high:
        middle = (low + high + 1) // 2
        low, high = (middle, high) if fits(middle) else (low, middle - 1)
    return low


def measure(shape: GPTShape, batch_size: int, steps: int, warmup: int, trials: int,
            float8_recipes: Sequence[Float8Recipe] = FLOAT8_RECIPES,
            device: torch.device | None = None, compile: bool = True,
            activation_checkpointing: CheckpointingPolicy = None) -> dict[str, Any]:
    """Run every variant ``trials`` times, alternating; ``device`` defaults to the GPU.
    ``activation_checkpointing`` is applied alike to the hand-written loop (the same block
    wrapping) and to every ``DreamTrainer`` variant."""
    device = device or torch.device("cuda")
    batches = make_batches(shape, batch_size, warmup + steps, device)
    tokens_per_step = batch_size * shape.seq_len
    runs: dict[str, list[dict[str, Any]]] = {"hand": [], "dream": [], "dream_no_callbacks": [],
                                             **{f"dream_float8_{r}": [] for r in float8_recipes}}
    common = {"device": device, "compile": compile,
              "activation_checkpointing": activation_checkpointing}
    with tempfile.TemporaryDirectory() as tmp:
        for trial in range(trials):
            workdir = Path(tmp) / str(trial)
            variants = {
                "hand": partial(hand_written, shape, batches, warmup, **common),
                "dream": partial(dream, shape, batches, warmup, batch_size, workdir, **common),
                "dream_no_callbacks": partial(dream, shape, batches, warmup, batch_size,
                                              workdir, **common, default_callbacks=False),
                **{f"dream_float8_{recipe}": partial(dream, shape, batches, warmup, batch_size,
                                                     workdir, **common, float8_recipe=recipe)
                   for recipe in float8_recipes},
            }
            for name, run in variants.items():
                runs[name].append(run())
                # A long run shows where it is, and a cut-off one still says what it measured.
                rate = steps * tokens_per_step / runs[name][-1]["seconds"]
                print(f"trial {trial} {name}: {rate:,.0f} tokens/s", file=sys.stderr, flush=True)
    n_params = runs["hand"][0]["n_params"]
    flops_per_token = shape.flops_per_token(n_params)
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
    peak = peak_flops(device_name)
    result: dict[str, Any] = {
        "device": device_name, "torch": torch.__version__, "shape": asdict(shape),
        "batch_size": batch_size, "steps": steps, "warmup": warmup, "trials": trials,
        "n_params": n_params, "flops_per_token": flops_per_token, "peak_flops": peak,
        "compile": compile, "float8_recipes": list(float8_recipes),
        "activation_checkpointing": activation_checkpointing,
        "planned_gib": planned_bytes(shape, batch_size, activation_checkpointing) / 2**30,
    }
    for name, trial_runs in runs.items():
        rates = [steps * tokens_per_step / run["seconds"] for run in trial_runs]
        tokens_per_second = statistics.median(rates)
        result[name] = {
            "tokens_per_second": tokens_per_second,
            "tokens_per_second_trials": rates,
            "mfu": None if peak is None else tokens_per_second * flops_per_token / peak,
            "final_loss": [run["final_loss"] for run in trial_runs],
            "peak_memory_gib": None if device.type != "cuda"
            else max(run["peak_memory_gib"] for run in trial_runs),
        }
        if name.startswith("dream"):
            result[name]["float8_layers"] = trial_runs[0]["float8_layers"]
    for name in ("dream", "dream_no_callbacks"):
        result[f"{name}_over_hand_throughput"] = (result[name]["tokens_per_second"]
                                                  / result["hand"]["tokens_per_second"])
    for recipe in float8_recipes:
        result[f"dream_float8_{recipe}_over_dream_throughput"] = (
            result[f"dream_float8_{recipe}"]["tokens_per_second"]
            / result["dream"]["tokens_per_second"])
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--trials", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--model", choices=("gpt", "llama3-8b-widths"), default="gpt",
                        help="gpt: the ~0.9B decoder the widths below give; llama3-8b-widths: "
                             "Llama 3 8B's widths (benchmarks.gpt.LLAMA3_8B_WIDTHS), with as "
                             "many layers as the planner says fit 90%% of this GPU unless "
                             "--layers is given")
    parser.add_argument("--d-model", type=int, default=2048)
    parser.add_argument("--layers", type=int)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--seq-len", type=int)
    parser.add_argument("--activation-checkpointing", type=_policy, default=None,
                        help="full, selective or N (every N-th block), for every variant")
    parser.add_argument("--float8", nargs="*", default=list(FLOAT8_RECIPES),
                        choices=get_args(Float8Recipe),
                        help="float8 recipes to run beside bfloat16 (none: --float8 alone)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks.gpu_throughput needs a CUDA GPU")
    torch.backends.cuda.matmul.allow_tf32 = True
    if args.model == "gpt":
        shape = GPTShape(d_model=args.d_model, n_layers=args.layers or 16, n_heads=args.heads,
                         seq_len=args.seq_len or 2048)
    else:
        shape = replace(LLAMA3_8B_WIDTHS, seq_len=args.seq_len or LLAMA3_8B_WIDTHS.seq_len)
        # The planner leaves out the CUDA context, kernels' workspaces and fragmentation.
        budget = int(0.9 * torch.cuda.get_device_properties(0).total_memory)
        layers = args.layers or min(
            layers_that_fit(shape, args.batch_size, budget, args.activation_checkpointing,
                            recipe) for recipe in [None, *args.float8])
        shape = replace(shape, n_layers=layers)
    result = measure(shape, args.batch_size, args.steps, args.warmup, args.trials,
                     args.float8, activation_checkpointing=args.activation_checkpointing)
    result["model"] = args.model
    print(json.dumps(result, indent=2))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))


def _policy(text: str) -> CheckpointingPolicy:
    return int(text) if text.isdigit() else text  # type: ignore[return-value]


if __name__ == "__main__":
    main()
