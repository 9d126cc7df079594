"""Every exception dream_trainer defines, in the lowest layer so that any module can raise it.

The public ones are also exported where users look for them: ``StopTraining`` from
``dream_trainer``, ``MeshMismatchError`` from ``dream_trainer.world``, ``CheckpointError`` from
``dream_trainer.checkpoint``.
"""


class StopTraining(Exception):
    """Raise from a hook to end ``fit()`` cleanly at that point (every rank must raise it).

    ``fit()`` fires ``post_fit``, tears the process group down and returns normally.
    """


class MeshMismatchError(ValueError):
    """The configured mesh degrees do not fit the number of launched processes."""


class CheckpointError(RuntimeError):
    """A checkpoint cannot be used: missing, incomplete, damaged or incompatible."""


class RecoveryError(RuntimeError):
    """Applying the state copied from a live peer replica group failed."""


class TargetError(Exception):
    """A command's TARGET names no usable trainer factory; the message says what is wrong."""
