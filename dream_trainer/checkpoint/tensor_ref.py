"""``TensorRef``: what stands for a tensor in a blob of Python objects that a checkpoint
stores whole (``checkpoint.state``), the tensor itself saved by DCP beside it. Below both the
state that writes one and the allowlist that builds one when a blob is read."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TensorRef:
    """Where a tensor stood in a blob; the tensor itself is saved by DCP under ``path``."""

    path: str


# Checkpoints name the class where it was first defined (``checkpoint.state`` imports it), so
# that a dream_trainer from before the move still reads the checkpoints written now.
TensorRef.__module__ = "dream_trainer.checkpoint.state"
