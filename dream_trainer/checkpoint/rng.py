"""Capturing and restoring every random generator of one rank."""

from __future__ import annotations

import random
from typing import Any

import torch


def rng_state() -> dict[str, Any]:
    """python, numpy (when installed), torch CPU and every CUDA device's generator state, in
    plain types and tensors: what a checkpoint's allowlist reads back without numpy's
    classes."""
    state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    try:
        import numpy as np
    except ImportError:
        pass
    else:
        name, keys, position, has_gauss, cached = np.random.get_state()
        state["numpy"] = (str(name), torch.from_numpy(keys.astype(np.int64)), int(position),
                          int(has_gauss), float(cached))
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "numpy" in state:
        import numpy as np

        name, keys, position, has_gauss, cached = state["numpy"]
        np.random.set_state((name, keys.cpu().numpy().astype(np.uint32), position, has_gauss,
                             cached))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def resized_streams(saved_world_size: int, world_size: int) -> str:
    """One line saying what becomes of per-rank random generator streams when a checkpoint
    written by ``saved_world_size`` processes resumes on ``world_size``.

    Each rank restores the streams saved by the rank of the same number, where there is one;
    a rank the checkpoint has none for keeps the generators its setup seeded.
    """
    shared = min(saved_world_size, world_size)
    line = (f"the checkpoint was written by {_processes(saved_world_size)} and this run has "
            f"{world_size}, so per-rank random generator streams do not carry over exactly: "
            f"on {_ranks(0, shared)} the streams saved by the same rank are restored; ")
    if world_size > saved_world_size:
        return line + (f"on {_ranks(saved_world_size, world_size)} none were saved, so the "
                       "generators stay as this run's setup left them (seeded with config.seed)")
    return line + f"the streams saved by {_ranks(world_size, saved_world_size)} are unused"


def _processes(count: int) -> str:
    return f"{count} process" if count == 1 else f"{count} processes"


def _ranks(start: int, stop: int) -> str:
    return f"rank {start}" if stop - start == 1 else f"ranks {start}-{stop - 1}"
