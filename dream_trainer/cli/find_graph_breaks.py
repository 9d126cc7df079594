"""``dream-trainer find-graph-breaks``: where and why ``torch.compile`` splits each block."""

from __future__ import annotations

import argparse
import itertools
import sys
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from dream_trainer.cli.arguments import add_target
from dream_trainer.cli.tool_run import run_tool
from dream_trainer.parallel.blocks import find_blocks
from dream_trainer.planning.session import sandboxed, set_up, without_callbacks_or_compilation
from dream_trainer.trainer.base import BaseTrainer

# Lines of a dynamo graph-break reason after which it only addresses torch developers.
_REASON_END = ("Developer debug context", "For more details")


@dataclass
class BlockReport:
    """What ``torch._dynamo.explain`` found for one block."""

    name: str
    kind: str
    graphs: int
    breaks: list[str]


def add_parser(commands: Any) -> argparse.ArgumentParser:
    parser = commands.add_parser(
        "find-graph-breaks", allow_abbrev=False,
        help="report where torch.compile breaks each compiled block's graph, and why",
        description="In one process, set the trainer up as fit() would (without compilation), run one optimizer step "
                    "on the first train batches to record the inputs of every block that "
                    "apply_compile compiles by default (the blocks find_blocks returns, or each "
                    "whole model without blocks), then run torch._dynamo.explain on each block "
                    "with those inputs and print every graph break with its reason and the "
                    "line of your code that caused it. Blocks with the same breaks as an "
                    "earlier one of their class are listed once. Checkpoints and logs are "
                    "kept out of the run's directories.")
    add_target(parser)
    parser.set_defaults(run=run)
    return parser


def run(args: argparse.Namespace, overrides: list[str]) -> int:
    return run_tool(args, overrides, _explain, _print, one_process=True)


def _explain(args: argparse.Namespace, trainer: BaseTrainer) -> list[BlockReport]:
    # Eager blocks, so that explain sees the user's code; no callbacks, since one step runs
    # outside of fit().
    without_callbacks_or_compilation(trainer)
    with sandboxed(trainer):
        with set_up(trainer):
            return _explain_blocks(trainer)


def _explain_blocks(trainer: BaseTrainer) -> list[BlockReport]:
    blocks = _compiled_units(trainer)
    inputs = _record_inputs(trainer, blocks)
    reports = []
    for name, block in blocks.items():
        if name not in inputs:
            print(f"{name}: not called by the training step, not explained", file=sys.stderr)
            continue
        block_args, block_kwargs = inputs[name]
        with trainer.precision.autocast():
            explained = torch._dynamo.explain(block)(*block_args, **block_kwargs)
        reports.append(BlockReport(name, type(block).__name__, explained.graph_count,
                                   [_describe(reason) for reason in explained.break_reasons]))
        torch._dynamo.reset()
    return reports


def _compiled_units(trainer: BaseTrainer) -> dict[str, nn.Module]:
    """The modules the default ``apply_compile`` compiles, by dotted name (set up without
    compilation, so they run eagerly)."""
    units: dict[str, nn.Module] = {}
    for model_name, model in trainer.named_models().items():
        blocks = find_blocks(model)
        if not blocks:
            units[model_name] = model
        names = {id(module): name for name, module in model.named_modules()}
        for container, block_name, block in blocks:
            units[f"{model_name}.{names[id(container)]}.{block_name}".replace("..", ".")] = block
    return units


def _record_inputs(trainer: BaseTrainer, blocks: dict[str, nn.Module]
                   ) -> dict[str, tuple[tuple[Any, ...], dict[str, Any]]]:
    """Each block's arguments at its first call in the first optimizer step of the loader."""
    recorded: dict[str, tuple[tuple[Any, ...], dict[str, Any]]] = {}

    def recorder(name: str) -> Any:
        def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            if name not in recorded:
                recorded[name] = (tuple(_detached(a) for a in args),
                                  {k: _detached(v) for k, v in kwargs.items()})
        return hook

    handles = [block.register_forward_pre_hook(recorder(name), with_kwargs=True)
               for name, block in blocks.items()]
    window = list(itertools.islice(trainer.train_dataloader,
                                   trainer.training_parameters.gradient_accumulation_steps))
    try:
        trainer.train_window(window)
    finally:
        for handle in handles:
            handle.remove()
    return recorded


def _detached(value: Any) -> Any:
    return value.detach() if isinstance(value, torch.Tensor) else value


def _describe(reason: Any) -> str:
    """The user's line that broke the graph, then dynamo's reason for the user."""
    lines = []
    for line in str(reason.reason).splitlines():
        if line.strip().startswith(_REASON_END):
            break
        if line.strip():
            lines.append(line.strip())
    frames = list(reason.user_stack)
    where = (f"{frames[-1].filename}:{frames[-1].lineno} in {frames[-1].name}" if frames
             else "(no user frame)")
    source = f"\n    {frames[-1].line.strip()}" if frames and frames[-1].line else ""
    return where + source + "".join(f"\n    {line}" for line in lines)


def _print(args: argparse.Namespace, trainer: BaseTrainer, reports: list[BlockReport]) -> int:
    seen: dict[tuple[str, tuple[str, ...]], str] = {}
    total = 0
    for report in reports:
        count = len(report.breaks)
        total += count
        header = (f"{report.name} ({report.kind}): {report.graphs} "
                  f"graph{'s' if report.graphs != 1 else ''}, {count} "
                  f"graph break{'s' if count != 1 else ''}")
        same = seen.setdefault((report.kind, tuple(report.breaks)), report.name)
        if same != report.name:
            print(f"{header}, the same as {same}")
            continue
        print(header)
        for index, description in enumerate(report.breaks, start=1):
            print(f"  {index}. {description}")
    print(f"{len(reports)} block{'s' if len(reports) != 1 else ''} explained, {total} graph "
          f"break{'s' if total != 1 else ''} in all")
    return 0
