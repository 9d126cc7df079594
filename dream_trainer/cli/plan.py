"""``dream-trainer plan``: a large run's memory and collectives per rank, on one CPU."""

from __future__ import annotations

import argparse
import json
import sys
import textwrap
from typing import Any

from pydantic import ValidationError

from dream_trainer.cli.arguments import add_target, policy_overrides, positive_int, refusal
from dream_trainer.cli.target import TargetError, load_trainer
from dream_trainer.planning.report import (CONTEXT_PARALLEL, MEASURED, POLICIES, SAVED, RankPlan,
                                           SizePlan, parse_size, policy_table, table, to_json)
from dream_trainer.planning.saved import SavedActivations
from dream_trainer.planning.simulate import describe_failure, plan_rank
from dream_trainer.world.dims import MeshAxis


def add_parser(commands: Any) -> argparse.ArgumentParser:
    parser = commands.add_parser(
        "plan", allow_abbrev=False,
        help="simulate ranks of a large job on one CPU: memory and collectives per rank",
        description="For each world size, build the trainer as one rank of that job on torch's "
                    "fake process-group backend, run its setup (mesh, tensor parallelism, "
                    "FSDP2, materialization) and one optimizer step on fake tensors (shapes "
                    "without storage or arithmetic), and report what the rank holds "
                    "(parameters, gradients, optimizer state, activations) and what the step "
                    "sends on each mesh axis. An error the run would raise at that size (a "
                    "mesh or a shape that does not divide, too little data per rank) is "
                    "reported as raised. Time and bandwidth are not measured.")
    add_target(parser)
    parser.add_argument("--world-size", type=_sizes, required=True, metavar="N[,M...]",
                        help="world sizes to plan, comma-separated (8,64,1024)")
    parser.add_argument("--nproc-per-node", type=positive_int, metavar="G",
                        help="processes per node, which set each rank's local rank "
                             "(default: 8, or the world size if smaller)")
    parser.add_argument("--rank", type=int, nargs="+", action="extend", metavar="R",
                        help="ranks to simulate at every size; negative counts from the end "
                             "(default: 0 -1, the first and the last)")
    parser.add_argument("--device-memory", type=_memory, metavar="SIZE",
                        help="memory of one device (80GiB): say whether each size fits")
    parser.add_argument("--json", action="store_true",
                        help="print one JSON object per world size instead of the tables")
    parser.add_argument("--activation-policies", action="store_true",
                        help="plan the first simulated rank of each world size again under "
                             "each activation checkpointing policy, with and without "
                             "activation offload, and print what each saves for backward")
    parser.set_defaults(run=run)
    return parser


def run(args: argparse.Namespace, overrides: list[str]) -> int:
    device_memory: int | None = args.device_memory
    plans, failed = [], False
    for world_size in args.world_size:
        plan = _plan_size(args, overrides, world_size)
        if plan.error is not None:
            failed = True
            print(f"dream-trainer plan: world size {world_size}: {plan.error}", file=sys.stderr)
        elif args.json:
            print(json.dumps(to_json(plan, device_memory)), flush=True)
        plans.append(plan)
    if not args.json and any(plan.ranks for plan in plans):
        ranks = " ".join(map(str, args.rank)) if args.rank else "0 and the last"
        first = next(rank for plan in plans for rank in plan.ranks.values())
        print(f"plan of {args.target}: ranks {ranks} of each world size simulated on torch's "
              f"fake backend, one optimizer step each ({first.micro_batches} micro-batch"
              f"{'es' if first.micro_batches > 1 else ''} from {first.batch_source})")
        print(table(plans, device_memory))
        print("\n" + textwrap.fill(MEASURED, width=100))
        if any(MeshAxis.CP.value in plan.mesh for plan in plans):
            print("\n" + textwrap.fill(CONTEXT_PARALLEL, width=100))
    if args.activation_policies:
        for plan in plans:
            if plan.ranks and not args.json:
                _print_policies(args, overrides, plan)
    too_big = any(plan.fits(device_memory) is False for plan in plans)
    return 1 if failed or too_big else 0


def _plan_size(args: argparse.Namespace, overrides: list[str], world_size: int) -> SizePlan:
    plan = SizePlan(world_size)
    nproc = args.nproc_per_node or min(8, world_size)
    if world_size % nproc:
        plan.error = (f"--nproc-per-node {nproc} does not divide the world size {world_size}: "
                      "every node runs the same number of processes")
        return plan
    ranks = []
    for rank in args.rank or (0, -1):
        resolved = rank + world_size if rank < 0 else rank
        if not 0 <= resolved < world_size:
            plan.error = f"rank {rank} is outside a world of {world_size} ranks"
            return plan
        ranks.append(resolved)
    for rank in dict.fromkeys(ranks):
        try:
            plan.ranks[rank] = plan_rank(lambda: load_trainer(args.target, overrides),
                                         world_size, rank, nproc)
        except (TargetError, ValidationError):
            raise  # the target or an override is wrong at every size
        except Exception as exc:
            plan.ranks.clear()
            plan.error = describe_failure(exc, rank)
            return plan
    return plan


def _print_policies(args: argparse.Namespace, overrides: list[str], plan: SizePlan) -> None:
    """Plan the size's first simulated rank under each of ``POLICIES`` and print the table."""
    rank = next(iter(plan.ranks))
    nproc = args.nproc_per_node or min(8, plan.world_size)
    rows: list[tuple[str, RankPlan | SavedActivations | str]] = []
    for label, policy, offload in POLICIES:
        chosen = [*overrides, *policy_overrides(policy, offload)]
        try:
            rows.append((label, plan_rank(lambda: load_trainer(args.target, chosen),
                                          plan.world_size, rank, nproc)))
        except ValidationError as exc:  # a combination the config refuses
            rows.append((label, refusal(exc)))
        except TargetError:
            raise
        except Exception as exc:
            rows.append((label, describe_failure(exc, rank)))
    print(f"\nactivation policies at world size {plan.world_size}, rank {rank}:")
    print(policy_table(rows))
    print("\n" + textwrap.fill(SAVED, width=100))


def _sizes(text: str) -> list[int]:
    try:
        sizes = [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a comma-separated list of world sizes (8,64,1024)") from None
    if any(size < 1 for size in sizes):
        raise argparse.ArgumentTypeError(f"world sizes must be at least 1, got {text}")
    return sizes


def _memory(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None

