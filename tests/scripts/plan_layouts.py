"""Plan tests/scripts/plan_trainer.py in several layouts, world sizes and ranks, in one process.

    python tests/scripts/plan_layouts.py OUT.json LAYOUT=OVERRIDES_JSON ... --sizes 8,64,1024

Writes ``{layout: {world_size: {rank: figures}}}``, with every collective by axis and kind,
for tests/planning/test_plan.py to compare with the analytic values.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

from dream_trainer.planning.simulate import plan_rank
from tests.scripts.plan_trainer import make_pipeline_trainer, make_trainer


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("layouts", nargs="+", help="NAME=device_parameters as JSON")
    parser.add_argument("--sizes", default="8,64,1024")
    args = parser.parse_args()
    results: dict[str, dict[int, dict[int, object]]] = {}
    for layout in args.layouts:
        name, device = layout.split("=", 1)
        results[name] = {}
        for world_size in map(int, args.sizes.split(",")):
            results[name][world_size] = {}
            for rank in sorted({0, world_size - 1}):
                # A pipeline needs the step API; the others use backward() as most users do.
                make = make_pipeline_trainer if "pipeline_parallel" in device else make_trainer
                plan = plan_rank(lambda: make(["--device_parameters", device]),
                                 world_size, rank, min(8, world_size))
                results[name][world_size][rank] = dataclasses.asdict(plan)
    args.out.write_text(json.dumps(results))


if __name__ == "__main__":
    main()
