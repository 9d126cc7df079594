"""Checkpoints in object storage: DCP save, async-save blocking time and load of the same
state to moto's S3 server on 127.0.0.1 through each client (fsspec/s3fs through DCP's
``FsspecWriter``/``FsspecReader``, s3torchconnector's ``S3StorageWriter``/``S3StorageReader``)
vs the local filesystem, ratios to the local figures taken in the same run.

Single process, CPU. The server runs in this process and keeps objects in memory, so the
figures measure each client's protocol and CPU costs, not a network's bandwidth. Each figure
is the median of ``--repeats`` runs.

    python -m benchmarks.object_store [--size-mb 64] [--repeats 3] [--json out.json]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch


def _state(size_mb: int) -> dict[str, torch.Tensor]:
    """``size_mb`` MiB of float32 in tensors of 4 MiB (a model's layers)."""
    per = (4 << 20) // 4
    return {f"layer{i}": torch.randn(per) for i in range(max(1, size_mb // 4))}


def _fsspec(url: str, load: bool) -> Any:
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter

    return FsspecReader(url) if load else FsspecWriter(url, sync_files=False)


def _s3torchconnector(url: str, load: bool) -> Any:
    from s3torchconnector import S3ClientConfig
    from s3torchconnector.dcp import S3StorageReader, S3StorageWriter

    config = S3ClientConfig(force_path_style=True)
    if load:
        return S3StorageReader("us-east-1", url, s3client_config=config)
    return S3StorageWriter("us-east-1", url, s3client_config=config)


def _local(path: str, load: bool) -> Any:
    import torch.distributed.checkpoint as dcp

    return dcp.FileSystemReader(path) if load else dcp.FileSystemWriter(path, sync_files=False)


def _timings(storage: Callable[[str, bool], Any], where: Callable[[int], str],
             state: dict[str, torch.Tensor], repeats: int) -> dict[str, float]:
    import torch.distributed.checkpoint as dcp

    saves, blocks, loads = [], [], []
    for trial in range(repeats):
        start = time.perf_counter()
        dcp.save(state, storage_writer=storage(where(2 * trial), False))
        saves.append(time.perf_counter() - start)
        start = time.perf_counter()
        future = dcp.async_save(state, storage_writer=storage(where(2 * trial + 1), False))
        blocks.append(time.perf_counter() - start)
        future.result()
        target = {key: torch.empty_like(value) for key, value in state.items()}
        start = time.perf_counter()
        dcp.load(target, storage_reader=storage(where(2 * trial), True))
        loads.append(time.perf_counter() - start)
        if not all(torch.equal(target[key], state[key]) for key in state):
            raise RuntimeError(f"{storage.__name__} loaded other values than it saved")
    return {"save_s": statistics.median(saves), "async_block_s": statistics.median(blocks),
            "load_s": statistics.median(loads)}


def measure(size_mb: int = 64, repeats: int = 3) -> dict[str, Any]:
    """Median timings per storage, and each object-store figure over the local one."""
    from tests.helpers.s3 import s3_server

    state = _state(size_mb)
    clients: dict[str, Callable[[str, bool], Any]] = {"fsspec": _fsspec}
    if importlib.util.find_spec("s3torchconnector") is not None:
        clients["s3torchconnector"] = _s3torchconnector
    result: dict[str, Any] = {"size_mb": size_mb, "repeats": repeats}
    with tempfile.TemporaryDirectory() as local, s3_server() as server:
        result["local"] = _timings(_local, lambda i: os.path.join(local, f"c{i}"), state,
                                   repeats)
        for name, client in clients.items():
            timings = _timings(client, lambda i, name=name: server.url(name, f"c{i}"), state,
                               repeats)
            result[name] = {**timings, **{f"{key}_over_local": value / result["local"][key]
                                          for key, value in timings.items()}}
    return result


def markdown(result: dict[str, Any]) -> list[str]:
    rows = []
    size = result["size_mb"]
    for name in ("local", "fsspec", "s3torchconnector"):
        run = result.get(name)
        if run is None:
            continue
        ratio = "" if name == "local" else (
            f" ({run['save_s_over_local']:.1f}x / {run['async_block_s_over_local']:.1f}x / "
            f"{run['load_s_over_local']:.1f}x local)")
        rows.append(f"| Object storage, {size} MiB, {name}: save / async-save block / load | "
                    f"{run['save_s']:.3f} s / {run['async_block_s']:.3f} s / "
                    f"{run['load_s']:.3f} s{ratio} |")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mb", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    result = measure(args.size_mb, args.repeats)
    print("\n".join(markdown(result)))
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
