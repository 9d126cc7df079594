"""What the safe decoder costs: a checkpoint's ``.metadata`` read by it and by ``pickle``.

The metadata of an FSDP2 checkpoint has a chunk per parameter per rank. This builds DCP's
metadata for ``tensors`` sharded over ``ranks`` (a 2,000-tensor model on 64 ranks: 128,000
chunks, about 18 MB) and times ``pickle.loads`` (what torch's DCP does) against
``safe_pickle.loads`` (what dream_trainer does; pure Python, with every value checked), the
median of ``trials``. A resume decodes the metadata twice (verify, then load); a save does not
decode it.

    python -m benchmarks.metadata_decode [--tensors 2000] [--ranks 64] [--trials 3]
"""

from __future__ import annotations

import argparse
import json
import pickle
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from dream_trainer.checkpoint.safe_pickle import loads


def metadata(tensors: int, ranks: int) -> Any:
    """DCP metadata of ``tensors`` bf16 weights of 64 rows per rank, row-sharded."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, Metadata,
                                                       MetadataIndex, TensorProperties,
                                                       TensorStorageMetadata)

    shapes, storage = {}, {}
    for index in range(tensors):
        fqn = f"state.models.model.layers.{index}.weight"
        offsets = [torch.Size([rank * 64, 0]) for rank in range(ranks)]
        shapes[fqn] = TensorStorageMetadata(
            TensorProperties(dtype=torch.bfloat16), torch.Size([64 * ranks, 4096]),
            [ChunkStorageMetadata(offset, torch.Size([64, 4096])) for offset in offsets])
        for rank, offset in enumerate(offsets):
            storage[MetadataIndex(fqn, offset, rank)] = _StorageInfo(
                f"__{rank}_0.distcp", index * 524_288, 524_288)
    return Metadata(shapes, storage_data=storage,
                    planner_data={fqn: tuple(fqn.split(".")) for fqn in shapes})


def measure(tensors: int = 2000, ranks: int = 64, trials: int = 3) -> dict[str, Any]:
    data = pickle.dumps(metadata(tensors, ranks))
    seconds: dict[str, list[float]] = {"pickle": [], "safe": []}
    for _ in range(trials):
        for name, decode in (("pickle", pickle.loads), ("safe", lambda raw: loads(raw, "bench"))):
            start = time.perf_counter()
            decoded = decode(data)
            seconds[name].append(time.perf_counter() - start)
    assert len(decoded.storage_data) == tensors * ranks  # the safe decoder read it all
    median = {name: statistics.median(times) for name, times in seconds.items()}
    return {"tensors": tensors, "ranks": ranks, "chunks": tensors * ranks,
            "megabytes": len(data) / 1e6, "seconds": median,
            "ratio_safe_to_pickle": median["safe"] / median["pickle"]}


def markdown(result: dict[str, Any]) -> list[str]:
    where = (f"{result['chunks']:,} chunks ({result['tensors']:,} tensors x {result['ranks']} "
             f"ranks, {result['megabytes']:.1f} MB)")
    return [f"| decode .metadata of {where}: pickle / safe decoder | "
            f"{result['seconds']['pickle']:.2f} s / {result['seconds']['safe']:.2f} s |",
            f"| safe decoder / pickle | {result['ratio_safe_to_pickle']:.1f} |"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tensors", type=int, default=2000)
    parser.add_argument("--ranks", type=int, default=64)
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    result = measure(args.tensors, args.ranks, args.trials)
    print("\n".join(markdown(result)))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
