"""The parts of a layout: each parallel dimension, and the build steps ordered among them, as
one small interface, and ``PARTS``, the one declaration of their order.

A layout (``Layout``, or ``PipelineLayout`` once per stage) runs every active part's
``on_meta`` in this order on the models ``configure_models`` built on the meta device, gives
the models storage and their initial values, then runs every active part's
``after_materialize`` in the same order. A part reaches the trainer only through its public
hooks (``BuildHooks``). docs/concepts.md, "The build order", is the one prose copy of the
order; a test holds the two equal.

A new dimension is a new part: declare it, place it in a trainer's ``parallel_parts`` (see
``with_part``), and nothing in the loop, the mixins, reporting or planning changes.
"""

from __future__ import annotations

import logging
from typing import Any, ClassVar, Protocol

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from dream_trainer.parallel.float8 import convert_to_float8
from dream_trainer.parallel.float8_experts import convert_experts_to_float8
from dream_trainer.configs.activation_policy import policy_label
from dream_trainer.configs.device import DeviceParameters
from dream_trainer.parallel.checkpointing import describe_policy
from dream_trainer.parallel.context import Context
from dream_trainer.parallel.data_parallel import DataParallelBackend, NoDataParallel, backend_for
from dream_trainer.parallel.experts import Experts
from dream_trainer.parallel.offload import offload_blocks
from dream_trainer.world.dims import MeshAxis, ParallelDims
from dream_trainer.world.world import DistributedWorld


logger = logging.getLogger(__name__)


class BuildHooks(Protocol):
    """The trainer as the parts see it: its public hooks (``SetupMixin``'s, which a trainer
    overrides for its own models) and the models they act on."""

    world: DistributedWorld
    config: Any

    def named_models(self) -> dict[str, nn.Module]: ...

    def apply_pipeline_parallel(self, pp_mesh: DeviceMesh) -> list[nn.Module]: ...

    def apply_tensor_parallel(self, tp_mesh: DeviceMesh) -> None: ...

    def apply_expert_parallel(self, ep_mesh: DeviceMesh) -> None: ...

    def apply_activation_checkpointing(self) -> None: ...

    def apply_compile(self) -> None: ...

    def apply_fully_shard(self, config: dict[str, Any]) -> None: ...

    def apply_replicate(self, mesh: DeviceMesh) -> None: ...

    def init_weights(self) -> None: ...

    def context_parallel_buffers(self) -> dict[str, int]: ...


class BuildSite(Protocol):
    """What a part reads of the layout that runs it (a ``Layout``)."""

    world: DistributedWorld
    data_parallel: DataParallelBackend
    experts: Experts
    context: Context


class Part:
    """One dimension of the layout (or a build step ordered among them).

    Subclasses set ``name`` and override what they do; the defaults do nothing, so a part
    states only its own work. ``active`` is read once the degrees are resolved, and an
    inactive part is never called.
    """

    name: ClassVar[str]
    """How docs, errors and ``with_part`` name the part."""

    def active(self, params: DeviceParameters, dims: ParallelDims) -> bool:
        """Whether the run's settings (``params``, the trainer's current ones) and resolved
        degrees use this part."""
        return False

    def on_meta(self, hooks: BuildHooks, layout: BuildSite) -> None:
        """Act on the models of ``hooks.named_models()`` while they are on the meta device
        (under a pipeline: on one stage of this rank, bound to the model attribute)."""

    def after_materialize(self, hooks: BuildHooks, layout: BuildSite) -> None:
        """Act on the built models once they hold their initial (or pretrained) values."""

    def describe(self, params: DeviceParameters, dims: ParallelDims) -> str:
        """What the part does in this run, in a few words (summaries and ``summarize``)."""
        return self.name

    def settings(self, params: DeviceParameters, dims: ParallelDims) -> dict[str, Any]:
        """The settings of ``params`` this part runs with, by field name, for reports."""
        return {}


class Float8Part(Part):
    """``float8_recipe``: eligible ``nn.Linear`` layers become torchao's ``Float8Linear``,
    routed experts float8 grouped products where the hardware has the kernel; first, so
    that every later part shards the float8 modules."""

    name = "float8"

    def active(self, params: DeviceParameters, dims: ParallelDims) -> bool:
        return params.float8_recipe is not None

    def on_meta(self, hooks: BuildHooks, layout: BuildSite) -> None:
        params, world = hooks.config.device_parameters, layout.world
        # torchao all-gathers float8 weights with tensorwise scales only.
        all_gather = params.float8_recipe == "tensorwise" and layout.data_parallel.shards
        for name, model in hooks.named_models().items():
            converted = convert_to_float8(model, params.float8_recipe, params.float8_filter,
                                          world.device, all_gather)
            logger.info("%s: %d Linear layers train in float8 (%s)", name, len(converted),
                        params.float8_recipe)
            experts = convert_experts_to_float8(model, world.device)
            if experts:
                logger.info("%s: %d routed expert modules train in float8 (rowwise)", name,
                            len(experts))

    def describe(self, params: DeviceParameters, dims: ParallelDims) -> str:
        return f"float8 ({params.float8_recipe})"


class TensorPart(Part):
    """``tensor_parallel > 1``: ``apply_tensor_parallel(tp_mesh)``."""

    name = "tensor"

    def active(self, params: DeviceParameters, dims: ParallelDims) -> bool:
        return dims.tp > 1

    def on_meta(self, hooks: BuildHooks, layout: BuildSite) -> None:
        hooks.apply_tensor_parallel(layout.world.launched_mesh(MeshAxis.TP))

    def describe(self, params: DeviceParameters, dims: ParallelDims) -> str:
        return f"tensor parallel over {dims.tp} ranks"


class ExpertPart(Part):
    """``expert_parallel > 1``: ``apply_expert_parallel(ep_mesh)``, after tensor parallelism
    (whose ranks route the same tokens alike) and before FSDP2 shards what is left."""

    name = "expert"

    def active(self, params: DeviceParameters, dims: ParallelDims) -> bool:
        return dims.ep > 1

    def on_meta(self, hooks: BuildHooks, layout: BuildSite) -> None:
        hooks.apply_expert_parallel(layout.world.launched_mesh(MeshAxis.EP))

    def describe(self, params: DeviceParameters, dims: ParallelDims) -> str:
        return f"experts split over {dims.ep} ranks"

    def settings(self, params: DeviceParameters, dims: ParallelDims) -> dict[str, Any]:
        return {"expert_parallel": dims.ep}


class CheckpointingPart(Part):
    """``activation_checkpointing`` (or its synonym ``checkpoint_activations=True``):
    ``apply_activation_checkpointing()``, whose default wraps blocks as the policy says."""

    name = "activation checkpointing"

    def active(self, params: DeviceParameters, dims: ParallelDims) -> bool:
        return params.activation_checkpointing is not None

    def on_meta(self, hooks: BuildHooks, layout: BuildSite) -> None:
        hooks.apply_activation_checkpointing()

    def describe(self, params: DeviceParameters, dims: ParallelDims) -> str:
        return f"activation checkpointing: {describe_policy(params.activation_checkpointing)}"

    def settings(self, params: DeviceParameters, dims: ParallelDims) -> dict[str, Any]:
        return {"activation_checkpointing": policy_label(params.activation_checkpointing)}


class OffloadPart(Part):
    """``activation_offload``: every block (``find_blocks``) of every model, checkpointed or
    not, runs under saved-tensor hooks that move what it keeps for backward to host memory;
    after activation checkpointing, so that it offloads what the checkpoints keep."""

    name = "activation offload"

    def active(self, params: DeviceParameters, dims: ParallelDims) -> bool:
        return params.activation_offload

    def on_meta(self, hooks: BuildHooks, layout: BuildSite) -> None:
        for name, model in hooks.named_models().items():
            logger.info("%s: %d blocks offload their saved activations", name,
                        offload_blocks(model))

    def describe(self, params: DeviceParameters, dims: ParallelDims) -> str:
        return "saved activations offloaded to host memory, block by block"

    def settings(self, params: DeviceParameters, dims: ParallelDims) -> dict[str, Any]:
        return {"activation_offload": True}


class CompilePart(Part):
    """``compile_model``: ``apply_compile()``, inside FSDP2's units, outside the
    checkpointed blocks."""

    name = "compile"

    def active(self, params: DeviceParameters, dims: ParallelDims) -> bool:
        return params.compile_model

    def on_meta(self, hooks: BuildHooks, layout: BuildSite) -> None:
        hooks.apply_compile()


class DataParallelPart(Part):
    """Data parallelism: FSDP2 (HSDP with ``dp_replicate``) with the precision policy on the
    meta models when ``dp_shard x cp > 1``, the experts sharded first over their own ranks;
    else DDP over ``dp_replicate`` once the models hold values (DDP broadcasts rank 0's
    weights when it wraps a model)."""

    name = "data parallel"

    def active(self, params: DeviceParameters, dims: ParallelDims) -> bool:
        return backend_for(dims).name != NoDataParallel.name

    def on_meta(self, hooks: BuildHooks, layout: BuildSite) -> None:
        if layout.data_parallel.shards:
            config = fully_shard_config(hooks.config.device_parameters, layout.world)
            layout.experts.fully_shard(hooks.named_models().values(), config)
            hooks.apply_fully_shard(config)

    def after_materialize(self, hooks: BuildHooks, layout: BuildSite) -> None:
        if not layout.data_parallel.shards:  # DDP
            hooks.apply_replicate(layout.world.launched_mesh(MeshAxis.DP_REPLICATE))

    def describe(self, params: DeviceParameters, dims: ParallelDims) -> str:
        return backend_for(dims).describe(dims)


class ContextPart(Part):
    """``context_parallel > 1``: once the models are built, the layout's ``context`` finds
    what carries positions in them (``context_parallel_buffers()``, transformers' rotary
    embeddings); in the step it splits the sequences."""

    name = "context"

    def active(self, params: DeviceParameters, dims: ParallelDims) -> bool:
        return dims.cp > 1

    def after_materialize(self, hooks: BuildHooks, layout: BuildSite) -> None:
        layout.context.bind(hooks.context_parallel_buffers(), hooks.named_models())

    def describe(self, params: DeviceParameters, dims: ParallelDims) -> str:
        if params.context_parallel_load_balance:
            chunks, held = 2 * dims.cp, (f"load balanced: rank r holds chunks r and "
                                         f"{2 * dims.cp - 1}-r")
        else:
            chunks, held = dims.cp, "contiguous: rank r holds chunk r"
        return (f"each sequence split over {dims.cp} ranks along dim "
                f"{params.context_parallel_seq_dim} into {chunks} chunks ({held})")

    def settings(self, params: DeviceParameters, dims: ParallelDims) -> dict[str, Any]:
        return {"context_parallel_seq_dim": params.context_parallel_seq_dim,
                "context_parallel_load_balance": params.context_parallel_load_balance}


PARTS: tuple[Part, ...] = (Float8Part(), TensorPart(), ExpertPart(), CheckpointingPart(),
                           OffloadPart(), CompilePart(), DataParallelPart(), ContextPart())
"""The build order, first to last: the one declaration of it (docs/concepts.md copies it)."""


def with_part(part: Part, after: str, parts: tuple[Part, ...] = PARTS) -> tuple[Part, ...]:
    """``parts`` with ``part`` placed right after the one named ``after`` (``""``: first).

    Raises:
        ValueError: naming the parts, if none is named ``after`` or one is already named
            like ``part``.
    """
    names = [existing.name for existing in parts]
    if part.name in names:
        raise ValueError(f"a part named {part.name!r} is already in the order {names}: give "
                         "the new part another name")
    if after and after not in names:
        raise ValueError(f"no part named {after!r} to place {part.name!r} after: the parts "
                         f"are {names} (after='' places it first)")
    at = names.index(after) + 1 if after else 0
    return (*parts[:at], part, *parts[at:])


def fully_shard_config(params: DeviceParameters, world: DistributedWorld) -> dict[str, Any]:
    """``fully_shard``'s keyword arguments from ``params``: the FSDP mesh, the
    mixed-precision policy and the offload policy."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy

    precision = MixedPrecisionPolicy(
        param_dtype=None if params.param_dtype == torch.float32 else params.param_dtype,
        reduce_dtype=params.reduce_dtype,
    )
    # Pinned memory needs an accelerator; on a CPU-only machine pinning fails.
    offload = CPUOffloadPolicy(pin_memory=world.device.type == "cuda") \
        if params.cpu_offload else OffloadPolicy()
    return {"mesh": world.fsdp_mesh, "mp_policy": precision, "offload_policy": offload}
