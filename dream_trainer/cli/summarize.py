"""``dream-trainer summarize``: the config, world, models, optimizers and data, without training."""

from __future__ import annotations

import argparse
import functools
import io
import textwrap
from collections.abc import Iterable
from typing import Any

import torch.distributed as dist
from pydantic import ValidationError
from torch import nn

from dream_trainer.callbacks.summaries import ModelSummary, TrainerSummary
from dream_trainer.cli.arguments import add_target, non_negative_int, policy_overrides, refusal
from dream_trainer.cli.target import load_trainer
from dream_trainer.cli.tool_run import run_tool
from dream_trainer.configs.device import DeviceParameters
from dream_trainer.parallel.parts import ContextPart
from dream_trainer.parallel.pipeline import PipelineStages, describe_stage
from dream_trainer.planning.report import POLICIES, RankPlan, policy_table
from dream_trainer.planning.saved import SavedActivations, measure_real_step
from dream_trainer.planning.session import (attach, sandboxed, set_up,
                                            without_callbacks_or_compilation)
from dream_trainer.trainer.base import BaseTrainer
from dream_trainer.world.dims import MeshAxis, ParallelDims


def add_parser(commands: Any) -> argparse.ArgumentParser:
    parser = commands.add_parser(
        "summarize", allow_abbrev=False,
        help="print the config, world, models, optimizers and data of a trainer, untrained",
        description="Launch, configure and set up the trainer as fit() would (process group, "
                    "mesh, parallelism, materialization, optimizers, data), print what that "
                    "built, and tear it down without training. Checkpoints and logs go nowhere "
                    "near the configured directories.")
    add_target(parser)
    parser.add_argument("--depth", type=non_negative_int, default=1, metavar="D",
                        help="deepest level of submodules listed per model (default: 1)")
    parser.add_argument("--activations", action="store_true",
                        help="also set the trainer up again under each activation "
                             "checkpointing policy, with and without activation offload, run "
                             "one real optimizer step on the first batches of its loader and "
                             "report what its forward saved for backward (rank 0's)")
    parser.set_defaults(run=run)
    return parser


def run(args: argparse.Namespace, overrides: list[str]) -> int:
    return run_tool(args, overrides, functools.partial(_summarize, overrides=overrides), _print)


def _summarize(args: argparse.Namespace, trainer: BaseTrainer,
               overrides: list[str]) -> dict[str, str]:
    """Each section's title and text; empty on ranks other than 0, whose summaries are empty."""
    sections = _sections(args, trainer)
    if args.activations:
        # Collective (each policy's trainer is set up on every rank): after the summary's
        # trainer is torn down.
        table = _saved_per_policy(args, overrides)
        if sections:
            sections["saved for backward, one real step per activation policy"] = \
                f"{table}\n\n{textwrap.fill(MEASURED_SAVED, width=100)}"
    return sections


def _saved_per_policy(args: argparse.Namespace, overrides: list[str]) -> str:
    rows: list[tuple[str, RankPlan | SavedActivations | str]] = []
    for label, policy, offload in POLICIES:
        try:
            trainer = load_trainer(args.target, [*overrides, *policy_overrides(policy, offload)])
        except ValidationError as exc:  # a combination the config refuses
            rows.append((label, refusal(exc)))
            continue
        # No callbacks, and eager blocks: the step is measured op by op.
        without_callbacks_or_compilation(trainer)
        with sandboxed(trainer), set_up(trainer):
            rows.append((label, measure_real_step(trainer)))
    return policy_table(rows)


def _sections(args: argparse.Namespace, trainer: BaseTrainer) -> dict[str, str]:
    config_json = trainer.config.model_dump_json(indent=2)  # the user's, before the sandbox
    model_tables, schedule_table = io.StringIO(), io.StringIO()
    models = ModelSummary(max_depth=args.depth, stream=model_tables)
    schedule = TrainerSummary(stream=schedule_table)
    with sandboxed(trainer):
        attach(trainer, models, schedule)
        with set_up(trainer):
            stages = _pipeline_stages(trainer)  # a collective: before the ranks part
            if not trainer.world.is_rank_zero:
                return {}
            return {
                f"config ({type(trainer.config).__name__})": config_json,
                "world": _world(trainer),
                "models": "\n".join([model_tables.getvalue().rstrip()] + [
                    _model(name, model, models) for name, model in trainer.named_models().items()]
                    + stages),
                "optimizers": _optimizers(trainer),
                "data": _data(trainer, schedule.summary["optimizer_steps_per_epoch"]),
                "schedule": schedule_table.getvalue().rstrip(),
            }


MEASURED_SAVED = (
    "Measured in one real optimizer step per policy, on the first batches of the train "
    "loader, eager and without callbacks: what the first micro-batch's forward left alive "
    "when its backward began (activations autograd saved, checkpointed blocks' inputs, the "
    "outputs a selective policy keeps, the loss), parameters and the batch aside; 'on host' is "
    "what activation offloading copied to host memory. `dream-trainer plan "
    "--activation-policies` estimates the same bytes on fake tensors."
)


def _print(args: argparse.Namespace, trainer: BaseTrainer, sections: dict[str, str]) -> int:
    for title, body in sections.items():
        print(f"== {title} ==\n{body}\n")
    return 0


def _world(trainer: BaseTrainer) -> str:
    world = trainer.world
    axes = world.dims.mesh_axes()
    mesh = (" x ".join(f"{axis}={size}" for axis, size in axes) if axes
            else "none (every degree is 1)")
    data_parallel = (f"{trainer.data_parallel.name} over {world.dp_size} ranks"
                     if world.dp_size > 1 else "none")
    layout = trainer.layout.describe(trainer.config.device_parameters)
    lines = [f"world size {world.world_size}, device {world.device}, backend {world.backend}",
             f"mesh: {mesh}; data parallel: {data_parallel}"]
    if layout.parts:
        lines.append(f"parts, in build order: {', '.join(layout.parts)}")
    if ContextPart.name in layout.parts:
        lines.append(_context(world.dims, trainer.config.device_parameters))
    return "\n".join(lines)


def _context(dims: ParallelDims, device: DeviceParameters) -> str:
    """How context parallelism splits each sequence, and what FSDP2 shards over with it."""
    return (f"context parallel: {ContextPart().describe(device, dims)}; FSDP2 shards the "
            f"weights over dp_shard x cp = {dims.fsdp} ranks")


def _model(name: str, model: nn.Module, summary: ModelSummary) -> str:
    root = next(row for row in summary.rows if row.name == name and row.depth == 0)
    dtypes = sorted({str(p.dtype).removeprefix("torch.") for p in model.parameters()})
    return (f"{name}: {_wrapping(model)}, {'/'.join(dtypes) or 'no parameters'}, "
            f"{root.params:,} parameters ({root.trainable:,} trainable)")


def _wrapping(model: nn.Module) -> str:
    from torch.distributed.fsdp import FSDPModule
    from torch.nn.parallel import DistributedDataParallel

    modules = model.stages if isinstance(model, PipelineStages) else [model]
    if isinstance(model, DistributedDataParallel):
        wrapping = "DDP"
    elif any(isinstance(sub, FSDPModule) for module in modules for sub in module.modules()):
        wrapping = "FSDP2"
    else:
        wrapping = "plain"
    if isinstance(model, PipelineStages):
        return f"pipeline of {model.num_stages} stages ({wrapping} within each)"
    return wrapping


def _pipeline_stages(trainer: BaseTrainer) -> list[str]:
    """One line per pipeline stage, gathered from the ranks that hold them (collective)."""
    pipelines = [(name, model) for name, model in trainer.named_models().items()
                 if isinstance(model, PipelineStages)]
    if not pipelines:
        return []
    name, model = pipelines[0]
    params = trainer.config.device_parameters
    pp_rank = trainer.world.get_mesh(MeshAxis.PP).get_local_rank()  # type: ignore[union-attr]
    mine = [(stage_id, pp_rank, describe_stage(stage),
             sum(p.numel() for p in stage.parameters()))
            for stage_id, stage in zip(model.stage_ids, model.stages)]
    gathered: list[Any] = [None] * trainer.world.world_size
    dist.all_gather_object(gathered, mine)
    # Data- and tensor-parallel replicas of a stage report it again: keep one.
    stages = sorted({entry[0]: entry for rank_stages in gathered for entry in rank_stages}
                    .values())
    lines = [f"{name} pipeline: {params.pipeline_schedule}, {model.runner.microbatches} "
             f"microbatches per batch"]
    lines += [f"  stage {stage} on pipeline rank {rank}: {what} ({count:,} parameters)"
              for stage, rank, what, count in stages]
    return lines


def _optimizers(trainer: BaseTrainer) -> str:
    lines = []
    for name, optimizer in trainer.named_optimizers().items():
        groups = optimizer.param_groups
        count = sum(p.numel() for group in groups for p in group["params"])
        lines.append(f"{name}: {type(optimizer).__name__}, {_count(len(groups), 'param group')}, "
                     f"{_count(count, 'parameter')}, {_learning_rates(groups)}")
    for name, scheduler in trainer.named_schedulers().items():
        lines.append(f"{name}: {type(scheduler).__name__} on "
                     f"{_name_of(scheduler.optimizer, trainer.named_optimizers())}")
    return "\n".join(lines)


def _learning_rates(groups: list[dict[str, Any]]) -> str:
    """``lr`` as configured: torch's schedulers keep it as ``initial_lr`` when they replace
    ``lr`` with their first value (0 at the start of a warmup), which is then shown too."""
    groups = [group for group in groups if "lr" in group]
    if not groups:
        return "lr -"
    configured = ", ".join(f"{group.get('initial_lr', group['lr']):g}" for group in groups)
    if all(group.get("initial_lr", group["lr"]) == group["lr"] for group in groups):
        return f"lr {configured}"
    current = ", ".join(f"{group['lr']:g}" for group in groups)
    return f"lr {configured} (configured; the scheduler starts at {current})"


def _name_of(value: object, named: dict[str, Any]) -> str:
    return next((name for name, candidate in named.items() if candidate is value), "?")


def _data(trainer: BaseTrainer, steps: int) -> str:
    params = trainer.training_parameters
    batches = _count(steps * params.gradient_accumulation_steps, "batch", "batches")
    train = (f"train: {batches} of {params.train_batch_size} per rank per epoch (of "
             f"{_length(trainer.train_dataloader)} in the loader), "
             f"{_count(steps, 'optimizer step')} per epoch")
    loader = trainer.val_dataloader
    if loader is None:
        return f"{train}\nval: none"
    try:
        length = len(loader)  # type: ignore[arg-type]
    except TypeError:
        length = params.val_steps_per_epoch
    val = ("every batch (the loader has no len)" if length is None else
           _count(min(length, params.val_steps_per_epoch or length), "batch", "batches"))
    size = getattr(loader, "batch_size", None) or params.val_batch_size
    return f"{train}\nval: {val} of {size} per rank per pass"


def _length(loader: Iterable[Any]) -> str:
    try:
        return f"{len(loader):,}"  # type: ignore[arg-type]
    except TypeError:
        return "an unknown number (no len)"


def _count(n: int, noun: str, plural: str | None = None) -> str:
    return f"{n:,} {noun if n == 1 else plural or noun + 's'}"
