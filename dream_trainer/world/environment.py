"""The process environment: the launcher's variables and torch's, read and written here only."""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass

_ACTIVE: ContextVar[LaunchEnvironment | None] = ContextVar("dream_trainer_launch_environment",
                                                          default=None)


@dataclass(frozen=True)
class LaunchEnvironment:
    """What the launcher (torchrun, or none) told this process about its place in the world.

    Attributes:
        rank: Global rank of this process.
        local_rank: Rank on this node; picks the CUDA device.
        world_size: Number of processes in the job.
        local_world_size: Number of processes on this node.
        launched: True when a launcher set ``RANK``/``WORLD_SIZE`` (torchrun, SLURM wrappers).
        restart_count: How many times torchrun has restarted this worker group.
        backend: The process-group backend to create; ``None`` picks gloo on the CPU and
            nccl on CUDA. ``"fake"`` simulates this rank of a larger job in one process:
            collectives return at once and move no data (``dream-trainer plan``).
        launcher_pid: The process id of torchrun's agent, this process's parent, when the
            agent started it (``TORCHELASTIC_RUN_ID`` is set); the world ends this process
            when that parent is gone (``world.launcher_watch``). None otherwise.
    """

    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    local_world_size: int = 1
    launched: bool = False
    restart_count: int = 0
    backend: str | None = None
    launcher_pid: int | None = None

    @classmethod
    def current(cls) -> LaunchEnvironment:
        """The environment activated by the innermost ``activate()`` block, else
        ``from_environ()``: what a ``DistributedWorld`` built without one reads."""
        active = _ACTIVE.get()
        return active if active is not None else cls.from_environ()

    @contextmanager
    def activate(self) -> Iterator[LaunchEnvironment]:
        """Within the block, worlds constructed without an explicit environment (those of
        trainers built by a factory) read this one instead of the launcher's variables.

        Nothing is written to ``os.environ``; the previous environment is back on exit.
        """
        token = _ACTIVE.set(self)
        try:
            yield self
        finally:
            _ACTIVE.reset(token)

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> LaunchEnvironment:
        """Read torchrun's variables; a plain ``python train.py`` gives a world of one.

        Raises:
            ValueError: if the variables are present but inconsistent.
        """
        env = os.environ if environ is None else environ
        if "RANK" not in env and "WORLD_SIZE" not in env:
            return cls()
        try:
            rank = int(env["RANK"])
            world_size = int(env["WORLD_SIZE"])
            local_rank = int(env.get("LOCAL_RANK", rank))
            local_world_size = int(env.get("LOCAL_WORLD_SIZE", world_size))
            restart_count = int(env.get("TORCHELASTIC_RESTART_COUNT", 0))
        except (KeyError, ValueError) as exc:
            raise ValueError(
                f"incomplete launcher environment ({exc}): RANK and WORLD_SIZE must both be "
                "integers; launch with torchrun, or unset them to run a single process"
            ) from exc
        if not 0 <= rank < world_size:
            raise ValueError(f"RANK={rank} is outside WORLD_SIZE={world_size}")
        # torchrun's agent starts its workers itself (and sets TORCHELASTIC_RUN_ID), so it
        # is their parent; processes other launchers start (srun, a script's own
        # RANK/WORLD_SIZE) are not watched: their parent may not be the launcher.
        launcher_pid = os.getppid() if "TORCHELASTIC_RUN_ID" in env else None
        return cls(rank, local_rank, world_size, local_world_size, True, restart_count,
                   launcher_pid=launcher_pid)


FLIGHT_RECORDER_SIZE = "TORCH_FR_BUFFER_SIZE"
"""torch's variable for the flight recorder's ring buffer size, read when a process group
starts; ``TORCH_NCCL_TRACE_BUFFER_SIZE`` is its deprecated former name."""
_FLIGHT_RECORDER_SIZE_BEFORE = "TORCH_NCCL_TRACE_BUFFER_SIZE"


def set_flight_recorder_entries(entries: int) -> None:
    """Keep ``entries`` collectives in the flight recorder of process groups created later."""
    os.environ[FLIGHT_RECORDER_SIZE] = str(entries)
    # Set by the user under the old name, it is updated too, so that the two never disagree
    # for a torch that reads only that one.
    if _FLIGHT_RECORDER_SIZE_BEFORE in os.environ:
        os.environ[_FLIGHT_RECORDER_SIZE_BEFORE] = str(entries)
