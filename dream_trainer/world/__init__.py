"""Topology: launcher environment, mesh degrees and the process group of a run."""

from dream_trainer.world.dims import MeshAxis, MeshMismatchError, ParallelDims
from dream_trainer.world.environment import LaunchEnvironment
from dream_trainer.world.world import DistributedWorld

__all__ = ["DistributedWorld", "LaunchEnvironment", "MeshAxis", "MeshMismatchError",
           "ParallelDims"]
