"""What the step-time benchmarks of a 2-rank layout against one process share
(``pipeline_steps``, ``expert_steps``): a trainer mixin timing each optimizer step, the
torchrun trial of the 2-rank run, the summary of the per-trial ratios, and the command line.

Each such module runs the one-process side in this process and the 2-rank side as
``python -m torch.distributed.run --nproc_per_node=2 -m <module> --worker OUT --steps N``,
whose rank 0 saves ``(median step seconds, final full weights)`` to ``OUT``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from benchmarks.processes import child_env

Run = Callable[[int], tuple[float, dict[str, torch.Tensor]]]
"""``run(steps) -> (median step seconds, final full weights)`` of one side, in this process."""


def two_rank_trial(module: str, steps: int) -> tuple[float, dict[str, torch.Tensor]]:
    """Run ``module``'s 2-rank side under torchrun; return what its rank 0 saved."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "two_ranks.pt"
        command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
                   "--standalone", "-m", module, "--worker", str(out), "--steps", str(steps)]
        result = subprocess.run(command, env=child_env(), capture_output=True, text=True,
                                timeout=1200)
        if result.returncode != 0:
            raise RuntimeError(f"the 2-rank run of {module} failed:\n{result.stderr[-3000:]}")
        return torch.load(out)


def compare(one_process: Run, module: str, steps: int, trials: int) -> dict[str, Any]:
    """``trials`` times: the one-process run, then the 2-rank one; their median step times,
    the median (and spread) of the per-trial ratios 2 ranks / one process, and the largest
    difference between the two sides' final weights."""
    ones, twos, errors = [], [], []
    for _ in range(trials):
        one, reference = one_process(steps)
        two, weights = two_rank_trial(module, steps)
        ones.append(one)
        twos.append(two)
        errors.append(max(float((weights[name] - tensor).abs().max())
                          for name, tensor in reference.items()))
    ratios = [two / one for two, one in zip(twos, ones)]
    return {"one_process": statistics.median(ones), "two_ranks": statistics.median(twos),
            "ratio": statistics.median(ratios), "ratio_spread": [min(ratios), max(ratios)],
            "max_weight_difference": max(errors)}


def main(description: str, measure: Callable[[int, int], dict[str, Any]], worker: Run,
         default_steps: int) -> None:
    """The command line of such a module: measure and print (and write ``--json``), or, with
    ``--worker OUT``, be one rank of the 2-rank side."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--steps", type=int, default=default_steps)
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker is not None:
        seconds, weights = worker(args.steps)
        if int(os.environ.get("RANK", "0")) == 0:
            torch.save((seconds, weights), args.worker)
        return
    result = measure(args.steps, args.trials)
    print(json.dumps(result, indent=2))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
