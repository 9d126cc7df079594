"""The storage a run names, checked before its models are built: the checkpoint root
(``root_dir``), a checkpoint to ``resume`` from and the ``init_weights_from`` sources.

Without these checks a missing bucket or a read-only key is found when the run first touches
the storage: after the models are built and materialized, which takes minutes for a large
model. Each node's first process checks (the environment that holds the credentials is a
node's), and every rank raises the same error.
"""

from __future__ import annotations

import socket
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from dream_trainer.checkpoint.directory import INFO, METADATA, is_complete
from dream_trainer.checkpoint.storage import location, storage_for
from dream_trainer.checkpoint.storage_base import Location, ObjectPath
from dream_trainer.errors import CheckpointError
from dream_trainer.world.agree import gather_objects
from dream_trainer.world.world import DistributedWorld

if TYPE_CHECKING:
    from dream_trainer.checkpoint.pretrained import Sources

_PROBE = ".dream_trainer_write_check"
"""The name stem of the empty object the check writes and deletes under ``root_dir``."""


def check_checkpoint_storage(checkpoint_dir: Location, resume: str | Path | None,
                             world: DistributedWorld) -> None:
    """Check that the run can write its checkpoints under ``checkpoint_dir`` (an object
    store's: bucket, credentials, a write and a delete) and that ``resume``, when it names a
    checkpoint, is a complete one there (collective).

    Raises:
        CheckpointError: on every rank, naming the setting, the problem and the fix.
    """
    if not isinstance(checkpoint_dir, ObjectPath) and resume in (None, "latest"):
        return  # decided by the config alone, so every rank skips the collective alike
    problem = None
    if world.local_rank == 0:
        problem = _write_problem(checkpoint_dir, world.rank)
        if problem is None and resume not in (None, "latest"):
            problem = _resume_problem(location(resume))
    _raise_agreed(problem, world)


def check_weights_sources(sources: Sources, world: DistributedWorld) -> None:
    """Check that every ``init_weights_from`` source at an object-store URL can be read and
    exists (collective; local sources are checked when they are read, naming the file).

    Raises:
        CheckpointError: on every rank, naming the source, the problem and the fix.
    """
    each = sources.values() if isinstance(sources, Mapping) else [sources]
    paths = [location(path) for item in each
             for path in ([item] if isinstance(item, (str, Path)) else item)]
    urls = [path for path in paths if isinstance(path, ObjectPath)]
    if not urls:
        return
    problem = None
    if world.local_rank == 0:
        problem = next(filter(None, map(_source_problem, urls)), None)
    _raise_agreed(problem, world)


def _write_problem(directory: Location, rank: int) -> str | None:
    storage = storage_for(directory)
    # Named per process: the first processes of several nodes probe at once.
    probe = f"{_PROBE}.{socket.gethostname()}.{rank}"
    problem = storage.access_problem(directory, probe=probe)
    if problem is None:
        return None
    return (f"checkpoint_parameters.root_dir cannot hold this run's checkpoints: {problem} "
            "(checked before the models are built)")


def _resume_problem(path: Location) -> str | None:
    storage = storage_for(path)
    problem = storage.access_problem(path)
    if problem is not None:
        return f"cannot read checkpoint_parameters.resume={str(path)!r}: {problem}"
    try:
        if not storage.is_dir(path):
            return (f"resume={str(path)!r}: no checkpoint directory there (use 'latest' to "
                    "continue this experiment)")
        if not is_complete(path):
            return (f"{path} is not a complete checkpoint: it has no {METADATA} or {INFO}, "
                    "so its save never finished")
    except storage.failures as exc:
        return f"cannot read checkpoint_parameters.resume={str(path)!r}: " \
               f"{storage.explain(path, exc)}"
    return None


def _source_problem(path: Location) -> str | None:
    storage = storage_for(path)
    problem = storage.access_problem(path)
    if problem is None:
        try:
            if storage.is_dir(path):
                return None
        except storage.failures as exc:
            problem = storage.explain(path, exc)
        else:
            return (f"init_weights_from={str(path)!r} does not exist (nothing is stored under "
                    "it): give the URL of a Hugging Face weights directory or of a "
                    "dream_trainer checkpoint (step_<N>)")
    return f"cannot read init_weights_from={str(path)!r}: {problem}"


def _raise_agreed(problem: str | None, world: DistributedWorld) -> None:
    """Raise the first rank's problem on every rank (a simulated world's peers move no
    data, so it raises its own)."""
    problems = [problem] if world.simulated else gather_objects(problem)
    first = next((p for p in problems if p is not None), None)
    if first is not None:
        raise CheckpointError(first)
