"""Resume cost of a streaming train loader: today's replay against a stateful loader.

A stream of ``samples`` samples (each costs a seeded draw and a small matrix product to
"decode", as real samples cost decoding) is resumed at 10 % and at 90 % of its epoch. The
figure is the time from asking the trainer's ``TrainBatches`` for the resumed epoch to
holding its first batch:

- replay: a plain ``DataLoader`` over a dataset without state; the trainer reads and discards
  every batch already done, so the time grows with the position;
- stateful: torchdata's ``StatefulDataLoader`` over a dataset with ``state_dict()``; the
  trainer loads the position from the checkpoint and reads from there.

One process, CPU, no worker processes (so the figure is the data code's own), after one
untimed warm-up of each method, the median of ``--repeats`` runs; ratios are taken within
the run.

    python -m benchmarks.stream_resume [--samples 40000] [--repeats 3] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader, IterableDataset

from dream_trainer.data.stream import TrainBatches

BATCH = 16
FRACTIONS = (0.1, 0.9)


class DecodedStream(IterableDataset[torch.Tensor]):
    """``samples`` samples, each decoded from its index; its position is its state."""

    def __init__(self, samples: int) -> None:
        self.samples = samples
        self.position = 0
        self.weight = torch.randn(64, 64, generator=torch.Generator().manual_seed(0))

    def __iter__(self) -> Any:
        while self.position < self.samples:
            generator = torch.Generator().manual_seed(self.position)
            self.position += 1
            yield (torch.randn(8, 64, generator=generator) @ self.weight).sum(dim=0)

    def state_dict(self) -> dict[str, int]:
        return {"position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.position = state["position"]


class Stateless(IterableDataset[torch.Tensor]):
    """The same stream, without state: the only way to resume it is to read it again."""

    def __init__(self, samples: int) -> None:
        self.stream = DecodedStream(samples)

    def __iter__(self) -> Any:
        self.stream.position = 0
        return iter(self.stream)


def first_batch_seconds(batches: TrainBatches, start: int, stop: int) -> float:
    began = time.perf_counter()
    next(batches.epoch(0, start, stop))
    return time.perf_counter() - began


def replay(samples: int, start: int) -> float:
    loader = DataLoader(Stateless(samples), batch_size=BATCH)
    return first_batch_seconds(TrainBatches(loader, BATCH), start, samples // BATCH)


def stateful(samples: int, start: int) -> float:
    from torchdata.stateful_dataloader import StatefulDataLoader

    # The interrupted run: read up to the checkpoint and keep the loader's state (not timed).
    before = StatefulDataLoader(DecodedStream(samples), batch_size=BATCH)
    iterator = iter(before)
    for _ in range(start):
        next(iterator)
    saved = before.state_dict()
    batches = TrainBatches(StatefulDataLoader(DecodedStream(samples), batch_size=BATCH), BATCH)
    began = time.perf_counter()
    batches.load_state_dict({0: saved}, saved_dp=1, dp_size=1, dp_rank=0)
    next(batches.epoch(0, start, samples // BATCH))
    return time.perf_counter() - began


def measure(samples: int = 40_000, repeats: int = 3) -> dict[str, Any]:
    """Seconds to the first batch of the resumed epoch, per method and position."""
    batches = samples // BATCH
    for run in (replay, stateful):  # warm-up: first imports and allocations, not timed
        run(samples, 1)
    seconds: dict[str, dict[str, float]] = {}
    for fraction in FRACTIONS:
        start = int(batches * fraction)
        seconds[f"{fraction:.0%}"] = {
            method: statistics.median(run(samples, start) for _ in range(repeats))
            for method, run in (("replay", replay), ("stateful", stateful))}
    low, high = (f"{fraction:.0%}" for fraction in FRACTIONS)
    return {"samples": samples, "batch": BATCH, "seconds": seconds, "ratios": {
        f"replay {high} / replay {low}": seconds[high]["replay"] / seconds[low]["replay"],
        f"stateful {high} / stateful {low}": seconds[high]["stateful"] / seconds[low]["stateful"],
        f"replay / stateful at {high}": seconds[high]["replay"] / seconds[high]["stateful"]}}


def markdown(result: dict[str, Any]) -> list[str]:
    lines = [f"| resume a {result['samples']:,}-sample stream at {position}: {method} | "
             f"{seconds * 1e3:.1f} ms |"
             for position, figures in result["seconds"].items()
             for method, seconds in figures.items()]
    return lines + [f"| stream resume: {name} | {ratio:.1f} |"
                    for name, ratio in result["ratios"].items()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=40_000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    result = measure(args.samples, args.repeats)
    print("\n".join(markdown(result)))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
