"""What a failed checkpoint write tells the user: the real cause on each rank, the storage's
advice, the free space, and which checkpoint a resume would use instead."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from dream_trainer.checkpoint.agreement import innermost, root_cause
from dream_trainer.checkpoint.directory import CheckpointError, complete_checkpoints
from dream_trainer.checkpoint.storage import storage_for
from dream_trainer.checkpoint.storage_base import Location


@contextlib.contextmanager
def explain_write_errors(path: Location, directory: Location) -> Iterator[None]:
    """Turn a failed write of checkpoint ``path`` in the run's checkpoint ``directory`` (full
    disk, read-only directory, unreachable object store) into an error saying what is kept;
    the half-written checkpoint has no marker, so resume skips it.

    Raises:
        CheckpointError: for any failure of the storage or of DCP's save.
    """
    from torch.distributed.checkpoint.api import CheckpointException

    storage = storage_for(path)
    try:
        yield
    except (*storage.failures, CheckpointException) as exc:
        # DCP gathers every rank's error into one exception: name the real causes.
        errors = [innermost(error) for error in exc.failures.values()] \
            if isinstance(exc, CheckpointException) else [exc]
        cause = "; ".join(f"rank {rank}: {root_cause(error)}"
                          for rank, error in exc.failures.items()) \
            if isinstance(exc, CheckpointException) else str(exc)
        advice = next((found for error in errors
                       if (found := storage.advice(path, error)) is not None), None)
        raise CheckpointError(
            f"could not write checkpoint {path}: {cause}"
            + ("" if advice is None else f" ({advice})")
            + _free_space(directory) + ". Training state in memory is unchanged; resume "
            "would use " + _kept(directory)
        ) from exc


def _free_space(directory: Location) -> str:
    try:
        free = storage_for(directory).free_bytes(directory)
    except OSError:
        return ""
    return "" if free is None else f" ({free} bytes free on its device)"


def _kept(directory: Location) -> str:
    """The checkpoint resume would use, for an error message (or why it is unknown)."""
    try:
        kept = complete_checkpoints(directory)
    except (*storage_for(directory).failures, CheckpointError) as exc:
        return f"the newest complete checkpoint (they cannot be listed now: {exc})"
    return str(kept[-1].path) if kept else "no checkpoint (none is complete)"
