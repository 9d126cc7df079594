"""How a run's model tensors come into being at setup: chosen once, read by the setup code."""

from __future__ import annotations

import contextlib
from typing import Any


class Materialization:
    """Real tensors with real values, as every training run has them.

    Setup allocates and initializes the models inside ``context()``; where ``has_values`` is
    False (a tool that only needs shapes, such as ``dream-trainer plan``, passes its own
    subclass to ``BaseTrainer.set_up``) it skips what reads values: the NaN sentinel fill, the
    full-tensor draws of sharded parameters, the check that every tensor was initialized, the
    replay of a pipeline's one-process initialization and pretrained weights.
    """

    has_values: bool = True
    """False when tensors have shapes and dtypes only."""

    def context(self) -> contextlib.AbstractContextManager[Any]:
        """What model allocation and initialization run inside (nothing, for real tensors)."""
        return contextlib.nullcontext()
