"""Mesh axes and the resolution of configured degrees against the real world size."""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import Enum

from dream_trainer.configs.device import (DEGREES, MESH_DEGREES, DeviceParameters,
                                          PipelineSchedule, degree_problem, pipeline_layout)
from dream_trainer.errors import MeshMismatchError


class MeshAxis(str, Enum):
    """Names of the device-mesh dimensions, outermost first, plus flattened views."""

    PP = "pp"
    DP_REPLICATE = "dp_replicate"
    DP_SHARD = "dp_shard"
    CP = "cp"
    TP = "tp"
    DP = "dp"
    """Flattened dp_replicate x dp_shard view, present when both are > 1."""
    DP_SHARD_TP = "dp_shard_tp"
    """Flattened dp_shard x tp view, present when both are > 1: FSDP2 x TP parameters and
    gradients are sharded over both, and reduce over it in one collective."""
    EFSDP = "efsdp"
    """With expert parallelism, the physical axis that replaces dp_shard's outer part: the
    ranks FSDP2 shards each rank's experts over (dp_shard x cp / ep; present even when 1)."""
    EP = "ep"
    """With expert parallelism, the ranks the experts are split over: dp_shard's inner part
    (dp_shard is then the flattened efsdp x ep view), or with context parallelism the
    flattened dp_shard_in_ep x cp view."""
    DP_SHARD_IN_EP = "dp_shard_in_ep"
    """With expert and context parallelism, the part of dp_shard that ep borrows besides
    every cp rank (ep / cp; present when > 1): dp_shard is the flattened efsdp x
    dp_shard_in_ep view."""
    DP_CP = "dp_cp"
    """Flattened dp_replicate x dp_shard x cp view, present when cp > 1: every rank that
    holds a different part of a batch's items, over which metrics are gathered."""
    DP_SHARD_CP = "dp_shard_cp"
    """Flattened dp_shard x cp view, present when cp > 1: context-parallel ranks hold the same
    weights, so FSDP2 shards them over both axes (as torchtitan does)."""

    def __str__(self) -> str:
        return self.value


# Each physical axis with its config field, in mesh order.
_AXIS_FIELDS = tuple((MeshAxis(short), field) for field, short in MESH_DEGREES.items())


@dataclass(frozen=True)
class ParallelDims:
    """Concrete mesh degrees for one world size, and the pipeline's layout: the resolved form
    of ``DeviceParameters``, computed once; everything else reads it."""

    pp: int
    dp_replicate: int
    dp_shard: int
    cp: int
    tp: int
    pp_stages_per_rank: int = 1
    """Pipeline stages each pipeline rank holds (``pipeline_stages_per_rank`` resolved)."""
    pp_microbatches: int = 1
    """Microbatches per pipeline step (``pipeline_microbatches`` resolved)."""
    ep: int = 1
    """Expert-parallel degree (``expert_parallel``): a divisor of ``dp_shard`` x ``cp`` and a
    multiple of ``cp``."""
    pp_schedule: PipelineSchedule = "1F1B"
    """The pipeline schedule (``pipeline_schedule``), which also places the stages on the
    ranks (``stage_ids``); "1F1B" without a pipeline."""

    @classmethod
    def resolve(cls, params: DeviceParameters, world_size: int) -> ParallelDims:
        """Replace an ``"auto"`` degree with what the world size leaves over, and check the
        resolved degrees by the rules the config checks fixed ones by (``degree_problem``).

        Raises:
            MeshMismatchError: if the degrees cannot multiply to ``world_size``, or the degree
                an ``"auto"`` resolved to breaks a rule (the config's message, and the value
                it resolved to).
        """
        degrees = {axis: getattr(params, name) for axis, name in _AXIS_FIELDS}
        fixed = math.prod(d for d in degrees.values() if d != "auto")
        described = " x ".join(f"{name}={degrees[axis]}" for axis, name in _AXIS_FIELDS)
        auto = [axis for axis, degree in degrees.items() if degree == "auto"]
        if auto:
            if world_size % fixed:
                raise MeshMismatchError(
                    f"mesh {described} cannot fill world size {world_size}: the fixed degrees "
                    f"multiply to {fixed}, which does not divide {world_size}; launch a multiple "
                    f"of {fixed} processes or change the degrees"
                )
            degrees[auto[0]] = world_size // fixed
        elif fixed != world_size:
            raise MeshMismatchError(
                f"mesh {described} has {fixed} ranks but the world size is {world_size}: make "
                f"the degrees multiply to {world_size}, set one of them to 'auto', or launch "
                f"with --nproc_per_node={fixed}"
            )
        resolved = [int(degrees[axis]) for axis, _ in _AXIS_FIELDS]
        # The config's rules skipped what an "auto" degree decides: they apply now, the same
        # rules for a resolved degree as for a fixed one.
        problem = degree_problem(params, {name: degree for (_, name), degree
                                          in zip(_AXIS_FIELDS, resolved)})
        if problem is not None:
            problem += "".join(f" ({name}='auto' is {degrees[axis]} on {world_size} ranks)"
                               for axis, name in _AXIS_FIELDS if axis in auto)
            raise MeshMismatchError(problem)
        pp = resolved[0]
        if pp == 1:
            return cls(*resolved, ep=params.expert_parallel)
        return cls(*resolved, *pipeline_layout(params, pp), ep=params.expert_parallel,
                   pp_schedule=params.pipeline_schedule)

    def degrees(self) -> dict[str, int]:
        """Every resolved degree by its config field (``DEGREES``' order): what reports and
        checks read instead of naming the degrees again."""
        return {field: getattr(self, short) for field, short in DEGREES.items()}

    @property
    def pp_stages(self) -> int:
        """Pipeline stages in all: ``pp`` x ``pp_stages_per_rank``."""
        return self.pp * self.pp_stages_per_rank

    @property
    def dp(self) -> int:
        """Total data-parallel degree (replicas x shards)."""
        return self.dp_replicate * self.dp_shard

    @property
    def world_size(self) -> int:
        return self.pp * self.dp * self.cp * self.tp

    @property
    def fsdp(self) -> int:
        """The ranks FSDP2 shards each parameter over: ``dp_shard`` x ``cp``. Context-parallel
        ranks train the same weights on different parts of each sequence, so they shard the
        weights and reduce the gradients with the data-parallel shards."""
        return self.dp_shard * self.cp

    @property
    def efsdp(self) -> int:
        """The ranks FSDP2 shards each rank's experts over (besides ``dp_replicate``):
        ``dp_shard`` x ``cp`` / ``ep``."""
        return self.fsdp // self.ep

    def dp_shard_axes(self) -> list[tuple[MeshAxis, int]]:
        """The physical axes ``dp_shard`` is built from, outermost first: itself, or with
        expert parallelism ``efsdp`` (even when 1) and the part of ``ep`` it lends (``ep``
        itself without context parallelism; ``dp_shard_in_ep`` beside the cp ranks that
        ``ep`` borrows whole, when > 1)."""
        if self.ep == 1:
            return [(MeshAxis.DP_SHARD, self.dp_shard)]
        lent = self.ep // self.cp
        if self.cp == 1:
            return [(MeshAxis.EFSDP, self.efsdp), (MeshAxis.EP, lent)]
        inner = [(MeshAxis.DP_SHARD_IN_EP, lent)] if lent > 1 else []
        return [(MeshAxis.EFSDP, self.efsdp), *inner]

    def mesh_axes(self) -> list[tuple[MeshAxis, int]]:
        """The physical mesh axes of size > 1, outermost first; dp_shard as
        ``dp_shard_axes()`` builds it (flattened back by the world)."""
        axes = []
        for axis, _ in _AXIS_FIELDS:
            if axis == MeshAxis.DP_SHARD and self.ep > 1:
                axes += self.dp_shard_axes()
            elif getattr(self, axis.value) > 1:
                axes.append((axis, getattr(self, axis.value)))
        return axes
