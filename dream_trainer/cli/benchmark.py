"""``dream-trainer benchmark``: time the optimizer steps of a user's trainer."""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

import torch
from typing_extensions import override

from dream_trainer.callbacks.throughput import Throughput
from dream_trainer.cli.arguments import add_target, non_negative_int, positive_int
from dream_trainer.cli.tool_run import run_tool, stopped_early
from dream_trainer.planning.session import train_steps
from dream_trainer.trainer.base import BaseTrainer
from dream_trainer.trainer.callback import RankZeroCallback


def add_parser(commands: Any) -> argparse.ArgumentParser:
    parser = commands.add_parser(
        "benchmark", allow_abbrev=False,
        help="time WARMUP + STEPS optimizer steps and report step time and throughput",
        description="Train for WARMUP + STEPS optimizer steps (more epochs than configured if "
                    "the data runs out) and report the step times after warm-up: median and "
                    "spread, steps/s and samples/s (train_batch_size x accumulation x "
                    "data-parallel ranks per step). Periodic checkpoints are off, logging is "
                    "off, and the checkpoint fit() writes at its end goes to a temporary "
                    "directory that is deleted: nothing is written into the run's directories.")
    add_target(parser)
    parser.add_argument("--steps", type=positive_int, default=20, metavar="N",
                        help="optimizer steps measured (default: 20)")
    parser.add_argument("--warmup", type=non_negative_int, default=5, metavar="W",
                        help="optimizer steps run first and not measured (default: 5)")
    parser.add_argument("--json", type=Path, metavar="PATH",
                        help="also write the figures and every measured step time as JSON")
    parser.set_defaults(run=run)
    return parser


def run(args: argparse.Namespace, overrides: list[str]) -> int:
    return run_tool(args, overrides, _measure, _print)


def _measure(args: argparse.Namespace, trainer: BaseTrainer) -> list[float]:
    """The step times after warm-up (fewer than ``--steps`` when a callback stopped it)."""
    throughput = Throughput(window=args.warmup + args.steps)
    train_steps(trainer, args.warmup + args.steps, _Synchronize(), throughput)
    return throughput.step_times[args.warmup:]


def _print(args: argparse.Namespace, trainer: BaseTrainer, times: list[float]) -> int:
    if len(times) < args.steps:
        return stopped_early(trainer, f"the {args.warmup + args.steps} asked for")
    figures = _figures(trainer, args.warmup, times)
    print(_report(figures))
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(figures, indent=2) + "\n")
        print(f"figures written to {args.json}")
    return 0


class _Synchronize(RankZeroCallback):
    """Wait for the GPU before each step is timed, so a step's time is its own work's."""

    @override
    def pre_train_epoch(self) -> None:
        self._wait()

    @override
    def post_train_batch(self, result: dict[str, Any], batch_idx: int) -> None:
        if not self.trainer.is_accumulating_gradients:
            self._wait()

    @override
    def post_val_epoch(self, result: dict[str, Any]) -> None:
        self._wait()

    def _wait(self) -> None:
        if self.trainer.world.device.type == "cuda":
            torch.cuda.synchronize(self.trainer.world.device)


def _figures(trainer: BaseTrainer, warmup: int, times: list[float]) -> dict[str, Any]:
    params = trainer.training_parameters
    world = trainer.world
    samples_per_step = trainer.global_batch_size
    steps_per_second = len(times) / sum(times)
    quartiles = statistics.quantiles(times, n=4) if len(times) > 1 else [times[0]] * 3
    return {
        "steps": len(times),
        "warmup_steps": warmup,
        "median_step_time_s": statistics.median(times),
        "mean_step_time_s": statistics.fmean(times),
        "stdev_step_time_s": statistics.stdev(times) if len(times) > 1 else 0.0,
        "p25_step_time_s": quartiles[0],
        "p75_step_time_s": quartiles[2],
        "min_step_time_s": min(times),
        "max_step_time_s": max(times),
        "steps_per_second": steps_per_second,
        "samples_per_second": steps_per_second * samples_per_step,
        "samples_per_step": samples_per_step,
        "train_batch_size": params.train_batch_size,
        "gradient_accumulation_steps": params.gradient_accumulation_steps,
        "dp_size": world.dp_size,
        "world_size": world.world_size,
        "device": str(world.device),
        "step_times_s": times,
    }


def _report(f: dict[str, Any]) -> str:
    def ms(key: str) -> str:
        return f"{f[key] * 1e3:.2f} ms"

    return "\n".join([
        f"steps: {f['steps']} measured after {f['warmup_steps']} warm-up steps "
        f"(world size {f['world_size']}, device {f['device']})",
        f"step time: median {ms('median_step_time_s')}, mean {ms('mean_step_time_s')} "
        f"± {ms('stdev_step_time_s')}, p25-p75 {ms('p25_step_time_s')} - "
        f"{ms('p75_step_time_s')}, min {ms('min_step_time_s')}, max {ms('max_step_time_s')}",
        f"steps/s: {f['steps_per_second']:.2f}",
        f"samples/s: {f['samples_per_second']:.1f} ({f['samples_per_step']} samples per step = "
        f"batch {f['train_batch_size']} x accumulation {f['gradient_accumulation_steps']} x "
        f"{f['dp_size']} data-parallel rank{'s' if f['dp_size'] > 1 else ''})",
    ])
