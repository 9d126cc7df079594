"""The end of a trainer's run, written once for ``fit()`` and for tools that call ``set_up()``."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from dream_trainer.trainer.abstract import AbstractTrainer
from dream_trainer.trainer.phases import call_through


@contextmanager
def torn_down(trainer: AbstractTrainer) -> Iterator[None]:
    """Tear ``trainer`` down when the block ends, as ``fit()`` does, also when it raises.

    The ``teardown`` hooks run first (every mixin's part, even under an override that forgot
    ``super()``), then the process group is shut down: gracefully, with a barrier, only when
    the block completed, since after a failure the other ranks may never reach the barrier.
    The shutdown runs even when a ``teardown`` hook raises.
    """
    completed = False
    try:
        yield
        completed = True
    finally:
        try:
            call_through(trainer, "teardown")
        finally:
            trainer.world.shutdown(graceful=completed)
