"""Data-parallel backends: what differs between a single device, DDP and FSDP2."""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from collections.abc import Iterator

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.nn.parallel import DistributedDataParallel

from dream_trainer.parallel.pipeline import PipelineStages
from dream_trainer.world.dims import ParallelDims


class DataParallelBackend(ABC):
    """How models are replicated and how gradient synchronisation is switched off.

    The trainer turns synchronisation off for every micro-batch but the last of an
    accumulation window, before that micro-batch's forward pass.
    """

    name: str
    shards: bool = False
    """Whether the parameters are sharded (FSDP2): FSDP2 then casts them itself, float8
    all-gathers in float8, and float16 needs the sharded gradient scaler."""

    @abstractmethod
    def set_gradient_sync(self, model: nn.Module, enabled: bool) -> None:
        """Enable or disable gradient synchronisation for ``model``'s next backward."""

    def after_validation(self, model: nn.Module) -> None:
        """Return ``model`` to its training layout after forward passes without backward."""

    @abstractmethod
    def describe(self, dims: ParallelDims) -> str:
        """How the models are replicated over ``dims``, in a few words (summaries)."""

    def local_pass(self, model: nn.Module) -> contextlib.AbstractContextManager[None]:
        """A context in which ``model``'s forward and backward run on this rank alone, for a
        diagnostic re-run that other ranks do not join (by default nothing to switch off).

        Raises:
            RuntimeError: where a pass cannot run without the other ranks (FSDP2).
        """
        return contextlib.nullcontext()


class NoDataParallel(DataParallelBackend):
    """One data-parallel rank: nothing to synchronise."""

    name = "single"

    def set_gradient_sync(self, model: nn.Module, enabled: bool) -> None:
        return None

    def describe(self, dims: ParallelDims) -> str:
        return "one data-parallel rank"


class DDPBackend(DataParallelBackend):
    """``DistributedDataParallel`` over the data-parallel mesh."""

    name = "ddp"

    def describe(self, dims: ParallelDims) -> str:
        return f"DDP over {dims.dp_replicate} replicas"

    def wrap(self, model: nn.Module, mesh: DeviceMesh, device: torch.device) -> nn.Module:
        """Wrap ``model`` in DDP; rank 0's parameters and buffers are broadcast to all ranks."""
        return DistributedDataParallel(
            model,
            process_group=mesh.get_group(),
            device_ids=[device] if device.type == "cuda" else None,
        )

    def set_gradient_sync(self, model: nn.Module, enabled: bool) -> None:
        # DDP decides whether to prepare its reducer during forward, so this must be set before
        # the forward pass of the micro-batch, not just before backward.
        if isinstance(model, DistributedDataParallel):
            model.require_backward_grad_sync = enabled

    def local_pass(self, model: nn.Module) -> contextlib.AbstractContextManager[None]:
        """No gradient all-reduce in backward and no buffer broadcast before forward; both
        flags are put back afterwards.

        One collective remains: DDP rebuilds its gradient buckets (a broadcast) in the first
        forward after its first synchronised backward. Before the second optimizer step,
        every rank must therefore make a pass here too (``NanGuard`` re-runs on every rank).
        """
        if not isinstance(model, DistributedDataParallel):
            return contextlib.nullcontext()
        return _without_sync(model)


class FSDPBackend(DataParallelBackend):
    """FSDP2 (``fully_shard``) over the shard axis, replicated across dp_replicate for HSDP."""

    name = "fsdp"
    shards = True

    def describe(self, dims: ParallelDims) -> str:
        cp = f" (dp_shard={dims.dp_shard} x context_parallel={dims.cp})" if dims.cp > 1 else ""
        hsdp = f", HSDP over {dims.dp_replicate} replicas" if dims.dp_replicate > 1 else ""
        return f"FSDP2 over {dims.fsdp} ranks{cp}{hsdp}"

    # torch.distributed.fsdp is imported where used: importing it costs about 0.9 s (it loads
    # DTensor and sympy), which runs that never shard should not pay at `import dream_trainer`.

    def set_gradient_sync(self, model: nn.Module, enabled: bool) -> None:
        # Without sync FSDP2 keeps unsharded gradients and skips reduce-scatter (and the HSDP
        # all-reduce) until the last micro-batch.
        from torch.distributed.fsdp import FSDPModule

        if isinstance(model, FSDPModule):
            model.set_requires_gradient_sync(enabled)

    def after_validation(self, model: nn.Module) -> None:
        # A forward without backward leaves the root's parameters gathered; anything that
        # changes the shards before the next forward (EMA, a checkpoint load) would be ignored.
        from torch.distributed.fsdp import FSDPModule

        # A pipeline's stage roots are FSDP modules outside its merged tree of submodules.
        roots = model.stages if isinstance(model, PipelineStages) else [model]
        for root in roots:
            for module in root.modules():
                if isinstance(module, FSDPModule):
                    module.reshard()

    def local_pass(self, model: nn.Module) -> contextlib.AbstractContextManager[None]:
        raise RuntimeError(
            "an FSDP2 model cannot run forward or backward on one rank alone: every pass "
            "all-gathers its parameter shards from the other ranks"
        )


@contextlib.contextmanager
def _without_sync(model: DistributedDataParallel) -> Iterator[None]:
    saved = model.require_backward_grad_sync, model.require_forward_param_sync
    model.require_backward_grad_sync = False
    model.require_forward_param_sync = False
    try:
        yield
    finally:
        model.require_backward_grad_sync, model.require_forward_param_sync = saved


def backend_for(dims: ParallelDims) -> DataParallelBackend:
    """The backend that matches the resolved mesh degrees: the one place that decides
    between FSDP2 (sharding over ``dp_shard x cp``), DDP and none; everything else reads
    the backend (``name``, ``shards``)."""
    if dims.fsdp > 1:
        return FSDPBackend()
    if dims.dp_replicate > 1:
        return DDPBackend()
    return NoDataParallel()
