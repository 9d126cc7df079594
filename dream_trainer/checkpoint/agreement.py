"""Checkpoint steps every rank takes part in: committing with checksums, verifying, the
run lock, and the errors each rank may have met, agreed on over the checkpoint group."""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from dream_trainer.checkpoint.directory import (CONFIG, METADATA, MODEL_PREFIX, CheckpointError,
                                                CheckpointInfo, checksum, checksum_share,
                                                verify_files, written_files)
from dream_trainer.checkpoint.storage import storage_for
from dream_trainer.checkpoint.storage_base import Location, RunLockLike
from dream_trainer.checkpoint.trust import safe_reader
from dream_trainer.utils.bounded import read_bounded
from dream_trainer.utils.text import printable

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


def load_failure(exc: BaseException, doing: str) -> CheckpointError:
    """A failed DCP load (its ``CheckpointException``, or any error) as one ``CheckpointError``:
    a refusal of dream_trainer's reader keeps its own message, which names the file and what
    is wrong; anything else is named after ``doing``, with each rank's root cause."""
    per_rank = getattr(exc, "failures", None)
    causes = [innermost(error) for error in per_rank.values()] \
        if isinstance(per_rank, dict) and per_rank else [innermost(exc)]
    if all(isinstance(cause, CheckpointError) for cause in causes) \
            and len({str(cause) for cause in causes}) == 1:
        return CheckpointError(str(causes[0]))
    return CheckpointError(f"{doing}: {failures(exc)}")


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
        with storage.open_file(file) as handle:
            config = json.loads(read_bounded(handle, file))
    except (OSError, ValueError, RecursionError) as exc:  # ValueError: not JSON or UTF-8,
        # or over the limit
        raise CheckpointError(f"{file} cannot be read: {type(exc).__name__}: {exc}") from exc
    if not isinstance(config, dict):
        raise CheckpointError(f"{file} holds a JSON {type(config).__name__}, not a config")
    return config


MAX_CHANGES_SHOWN = 50
"""The most config changes ``config_changes`` lists; the rest are counted."""
_MAX_VALUE_CHARS = 200  # of each value shown: a changed list of a million items is cut


def saved_config_or_none(path: Location) -> dict[str, Any] | None:
    """The checkpoint's config for the log of changes, or None (logged) when
    ``config.json`` is damaged: not fatal, since the state it describes is checksummed and
    loads whole."""
    try:
        return saved_config(path)
    except CheckpointError as exc:
        logger.warning("not comparing the config with the checkpoint's: %s", exc)
        return None


def log_config_changes(saved: dict[str, Any] | None, current_json: str) -> None:
    """Log how the config (``current_json``) differs from the checkpoint's ``saved``."""
    if saved is None:
        return
    changes = config_changes(saved, current_json)
    if changes:
        logger.warning("the config differs from the checkpoint's:\n  %s", "\n  ".join(changes))


def config_changes(saved: dict[str, Any], current_json: str) -> list[str]:
    """``key: saved -> current`` for every value of the config ``current_json`` that differs
    from ``saved`` (see ``saved_config``), in the order of the keys; beyond
    ``MAX_CHANGES_SHOWN``, one last line counts the others.

    Linear in the size of both configs: the two trees are walked together and a key's
    dotted name is joined only for the changes listed (joining every leaf's name would cost
    the depth times the leaves: gigabytes for a crafted ``config.json`` of 164 KB).
    """
    shown: list[str] = []
    count = 0
    for path, before, after in _changes(saved, json.loads(current_json), None):
        count += 1
        if len(shown) < MAX_CHANGES_SHOWN:
            shown.append(f"{printable(_dotted(path))}: {_shown(before)} -> {_shown(after)}")
    if count > len(shown):
        shown.append(f"... and {count - len(shown)} more changes")
    return shown


_ABSENT = object()
_Path = tuple[Any, str] | None  # (parent path, key): each node's path built once


def _changes(saved: Any, current: Any, path: _Path) -> Iterator[tuple[_Path, Any, Any]]:
    """Every leaf where the trees ``saved`` and ``current`` differ below ``path``, as
    (path, saved value, current value) with ``_ABSENT`` for a missing side, in the order
    of the dotted names. A loop over a stack rather than recursion: a value passed up
    through a chain of generators would cost the depth per leaf."""
    pending = [(saved, current, path)]
    while pending:
        saved, current, path = pending.pop()
        if not isinstance(saved, dict) and not isinstance(current, dict):
            if _value(saved) != _value(current):
                yield path, saved, current
            continue
        children = _children(saved if isinstance(saved, dict) else {},
                             current if isinstance(current, dict) else {}, path)
        pending += [child for _, child in sorted(children, key=lambda item: item[0],
                                                 reverse=True)]


def _children(saved: dict[Any, Any], current: dict[Any, Any], path: _Path
              ) -> list[tuple[str, tuple[Any, Any, _Path]]]:
    """The (saved, current, path) items below ``path``, each with the text its dotted names
    sort by: a leaf's own key, a tree's key and a dot (so that a sibling ``a-b`` comes
    between leaf ``a`` and ``a.x``, as sorting the joined names would place it). A key that
    is a leaf on one side and a tree on the other is both: the leaf against nothing, then
    the tree."""
    items = []
    for key in saved.keys() | current.keys():
        before, after = saved.get(key, _ABSENT), current.get(key, _ABSENT)
        name = str(key)
        child = (path, name)
        before_tree, after_tree = isinstance(before, dict), isinstance(after, dict)
        if not before_tree and not after_tree:
            items.append((name, (before, after, child)))
            continue
        leaf = after if before_tree else before
        if not isinstance(leaf, dict) and leaf is not _ABSENT:
            pair = (_ABSENT, leaf) if before_tree else (leaf, _ABSENT)
            items.append((name, (*pair, child)))
        items.append((f"{name}.", (before if before_tree else _ABSENT,
                                   after if after_tree else _ABSENT, child)))
    return items


def _value(leaf: Any) -> Any:
    """A leaf as compared: a missing one equals None (a field added with a None default is
    no change)."""
    return None if leaf is _ABSENT else leaf


def _dotted(path: _Path) -> str:
    """The dotted name of ``path``; of a name over ``_MAX_VALUE_CHARS``, its end and the
    count of the levels left out."""
    keys: list[str] = []
    length, skipped = 0, 0
    while path is not None:
        path, key = path
        if length + len(key) < _MAX_VALUE_CHARS:
            keys.append(key)
            length += len(key) + 1
        else:
            skipped += 1
            length = _MAX_VALUE_CHARS  # a level left out: keep none above it either
    if skipped:
        keys.append(f"<{skipped} levels>")
    return ".".join(reversed(keys))


def _shown(value: Any) -> str:
    text = "'<absent>'" if value is _ABSENT else repr(value)
    return text if len(text) <= _MAX_VALUE_CHARS else \
        f"{text[:_MAX_VALUE_CHARS]}... ({len(text)} characters)"
