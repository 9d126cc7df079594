"""Checkpoint steps every rank takes part in: committing with checksums, verifying, the
run lock, and the errors each rank may have met, agreed on over the checkpoint group."""

from __future__ import annotations

import dataclasses
import json
import logging
from typing import Any

import torch
import torch.distributed as dist

from dream_trainer.checkpoint.layout import (CONFIG, METADATA, MODEL_PREFIX, CheckpointError,
                                             CheckpointInfo, checksum, checksum_share,
                                             verify_files, written_files)
from dream_trainer.checkpoint.storage import Location, RunLockLike, storage_for
from dream_trainer.checkpoint.trust import safe_reader

logger = logging.getLogger(__name__)


def gather(value: Any, world_size: int, group: dist.ProcessGroup | None) -> list[Any]:
    """``value`` of every rank (a collective when there are several)."""
    if world_size == 1:
        return [value]
    gathered: list[Any] = [None] * world_size
    dist.all_gather_object(gathered, value, group=group)
    return gathered


def commit(info: CheckpointInfo, rank: int, world_size: int,
           group: dist.ProcessGroup | None) -> None:
    """Checksum every file of a written checkpoint (each rank a share), then let rank 0
    write ``dream_trainer.json`` with the digests, which makes the checkpoint complete."""

    files = written_files(info.path)
    mine = {name: checksum(info.path / name)
            for name in checksum_share(files, rank, world_size)}
    shares = gather(mine, world_size, group)
    if rank == 0:
        checksums = {name: digest for share in shares for name, digest in share.items()}
        dataclasses.replace(info, files=checksums).write()


def find_problem(path: Location, rank: int, world_size: int,
                 group: dist.ProcessGroup | None) -> str | None:
    """What is wrong with the checkpoint at ``path`` on any rank (each checks a share of its
    files), or None; every rank gets the same answer."""

    try:
        metadata = safe_reader(str(path)).read_metadata()
        verify_files(path, metadata, rank, world_size)
        problem = None
    except Exception as exc:  # a damaged .metadata raises anything unpickling does
        problem = str(exc) if isinstance(exc, CheckpointError) \
            else f"cannot read {path / METADATA}: {type(exc).__name__}: {exc}"
    return next((p for p in gather(problem, world_size, group) if p is not None), None)


def take_lock(directory: Location, rank: int, world_size: int,
              group: dist.ProcessGroup | None) -> RunLockLike | None:
    """Rank 0 locks the experiment's directory; every rank learns the outcome.

    Returns:
        The lock on rank 0, None elsewhere.

    Raises:
        CheckpointError: on every rank, naming the holder, if another run holds it.
    """
    lock, error = None, None
    if rank == 0:
        lock = storage_for(directory).lock(directory)
        try:
            lock.acquire()
        except CheckpointError as exc:
            lock, error = None, str(exc)
    errors = [error]
    if world_size > 1:
        dist.broadcast_object_list(errors, src=0, group=group)
    if errors[0] is not None:
        raise CheckpointError(errors[0])
    return lock


def failures(exc: BaseException) -> str:
    """Each failing rank's root cause (DCP's CheckpointException), or the error itself."""
    per_rank = getattr(exc, "failures", None)
    if not isinstance(per_rank, dict):
        return f"{type(exc).__name__}: {exc}"
    return "; ".join(f"rank {rank}: {root_cause(error)}"
                     for rank, error in sorted(per_rank.items()))


def innermost(error: BaseException | tuple[BaseException, Any]) -> BaseException:
    """The innermost cause of ``error`` (DCP keeps ``(exception, traceback)`` per rank)."""
    if isinstance(error, tuple):
        error = error[0]
    while error.__cause__ is not None or error.__context__ is not None:
        error = error.__cause__ or error.__context__  # type: ignore[assignment]
    return error


def root_cause(error: BaseException | tuple[BaseException, Any]) -> str:
    """The innermost cause of ``error`` as ``Type: message``."""
    error = innermost(error)
    return f"{type(error).__name__}: {error}"


def check_shapes(path: Location, models: dict[str, dict[str, Any]], metadata: Any) -> None:
    """Name every model tensor that the checkpoint lacks or holds with another shape.

    Raises:
        CheckpointError: listing them.
    """
    saved = metadata.state_dict_metadata
    problems = []
    for model, tensors in models.items():
        for name, tensor in tensors.items():
            if not isinstance(tensor, torch.Tensor):
                continue
            key = f"{MODEL_PREFIX}{model}.{name}"
            if key not in saved:
                problems.append(f"{model}.{name} (not in the checkpoint)")
            elif tuple(saved[key].size) != tuple(tensor.shape):
                problems.append(f"{model}.{name} (checkpoint {tuple(saved[key].size)}, "
                                f"model {tuple(tensor.shape)})")
    if problems:
        raise CheckpointError(f"{path} does not fit this trainer's models: "
                              + "; ".join(problems))


def saved_config(path: Location) -> dict[str, Any] | None:
    """The config the checkpoint at ``path`` was saved with, or None if it has no
    ``config.json``.

    Raises:
        CheckpointError: naming the file, if it is not a JSON object.
    """
    file = path / CONFIG
    storage = storage_for(path)
    if not storage.is_file(file):
        return None
    try:
        config = json.loads(storage.read_bytes(file))
    except (OSError, ValueError, RecursionError) as exc:  # ValueError: not JSON or UTF-8
        raise CheckpointError(f"{file} cannot be read: {type(exc).__name__}: {exc}") from exc
    if not isinstance(config, dict):
        raise CheckpointError(f"{file} holds a JSON {type(config).__name__}, not a config")
    return config


def config_changes(saved: dict[str, Any], current_json: str) -> list[str]:
    """``key: saved -> current`` for every value of the config ``current_json`` that differs
    from ``saved`` (see ``saved_config``)."""
    saved = _flatten(saved)
    current = _flatten(json.loads(current_json))
    return [f"{key}: {saved.get(key, '<absent>')!r} -> {current.get(key, '<absent>')!r}"
            for key in sorted(saved.keys() | current.keys())
            if saved.get(key) != current.get(key)]


def _flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(tree, dict):
        return {prefix: tree}
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        flat.update(_flatten(value, f"{prefix}.{key}" if prefix else str(key)))
    return flat
