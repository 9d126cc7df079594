"""Where and how to run: mesh degrees, precision, compilation, timeouts."""

from __future__ import annotations

from datetime import timedelta
from typing import Annotated, Any, Literal

import torch
from pydantic import (BeforeValidator, NonNegativeInt, PlainSerializer, PositiveInt,
                      WithJsonSchema, model_validator)

from dream_trainer.configs.base import ConfigModel

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}


def _parse_dtype(value: Any) -> torch.dtype:
    if isinstance(value, torch.dtype):
        if value in _DTYPES.values():
            return value
        value = str(value).removeprefix("torch.")
    if isinstance(value, str) and value.removeprefix("torch.") in _DTYPES:
        return _DTYPES[value.removeprefix("torch.")]
    raise ValueError(
        f"unknown dtype {value!r}: use one of {sorted(set(_DTYPES))} or the matching torch.dtype"
    )


TorchDType = Annotated[
    torch.dtype,
    BeforeValidator(_parse_dtype),
    PlainSerializer(lambda dtype: str(dtype).removeprefix("torch."), return_type=str),
    WithJsonSchema({"type": "string", "enum": sorted(_DTYPES)}),
]
"""A floating dtype given as ``torch.bfloat16`` or a name such as ``"bf16"``; serialized by name."""

Degree = PositiveInt | Literal["auto"]
"""A mesh degree: a positive size, or ``"auto"`` for whatever the world size leaves over."""

_DEGREE_FIELDS = ("dp_replicate", "dp_shard", "context_parallel", "tensor_parallel",
                  "pipeline_parallel")


class DeviceParameters(ConfigModel):
    """The device mesh and the numerics of a run.

    The mesh degrees multiply to the world size; at most one may be ``"auto"``. They are
    resolved against the real world size by ``DistributedWorld``, never written back here.
    """

    dp_replicate: Degree = 1
    """Data-parallel replicas (DDP, or the replicate axis of HSDP). When not given it is
    ``"auto"`` unless another degree is, so the default is data parallel over every rank."""
    dp_shard: Degree = 1
    """Data-parallel shards (FSDP2)."""
    context_parallel: Degree = 1
    """Context-parallel degree (not supported yet: must be 1)."""
    tensor_parallel: Degree = 1
    """Tensor-parallel degree."""
    pipeline_parallel: Degree = 1
    """Pipeline-parallel degree (not supported yet: must be 1)."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """``"auto"`` uses CUDA when available, else the CPU."""
    param_dtype: TorchDType = torch.float32
    """dtype of parameters in forward and backward (mixed precision when not float32)."""
    reduce_dtype: TorchDType = torch.float32
    """dtype of gradient reduction across data-parallel ranks."""
    compile_model: bool = False
    """Compile each model with ``torch.compile``."""
    checkpoint_activations: bool = False
    """Recompute activations in backward instead of storing them."""
    cpu_offload: bool = False
    """Keep FSDP2-sharded parameters and optimizer state on the CPU (needs ``dp_shard > 1``)."""
    init_timeout: timedelta = timedelta(minutes=10)
    """Collective timeout while the process group starts up and the model is set up."""
    train_timeout: timedelta = timedelta(minutes=5)
    """Collective timeout once the first training step has finished."""
    flight_recorder_entries: NonNegativeInt | None = None
    """Collectives the flight recorder keeps per process (its ring buffer), which
    ``HangWatchdog`` dumps when it ends a hung rank; ``0`` turns it off. Sets
    ``TORCH_FR_BUFFER_SIZE`` (formerly ``TORCH_NCCL_TRACE_BUFFER_SIZE``) before the process
    group starts. ``None`` leaves the environment, and so torch's default (torch 2.13
    records), as it is."""
    detect_anomaly: bool = False
    """Run ``fit()`` under ``torch.autograd.set_detect_anomaly(True)``: backward names the
    forward operation that produced a NaN or a failing gradient (slow: for debugging)."""

    @model_validator(mode="before")
    @classmethod
    def _default_replicate(cls, data: Any) -> Any:
        if isinstance(data, dict) and "dp_replicate" not in data:
            other_auto = any(data.get(name) == "auto" for name in _DEGREE_FIELDS)
            return {**data, "dp_replicate": 1 if other_auto else "auto"}
        return data

    @model_validator(mode="after")
    def _check_degrees(self) -> DeviceParameters:
        autos = [name for name in _DEGREE_FIELDS if getattr(self, name) == "auto"]
        if len(autos) > 1:
            raise ValueError(
                f"{' and '.join(autos)} are each 'auto': at most one mesh degree can be 'auto'; "
                "give the others explicit sizes"
            )
        for name in ("context_parallel", "pipeline_parallel"):
            if getattr(self, name) not in (1, "auto") or (name in autos):
                raise ValueError(
                    f"{name}={getattr(self, name)!r} is not supported yet: set {name}=1"
                )
        if self.cpu_offload and self.dp_shard == 1:
            raise ValueError(
                "cpu_offload=True needs FSDP2 sharding: set dp_shard > 1 (or 'auto'), "
                "or turn cpu_offload off"
            )
        if self.init_timeout <= timedelta(0) or self.train_timeout <= timedelta(0):
            raise ValueError("init_timeout and train_timeout must be positive durations")
        return self

    @classmethod
    def SINGLE_DEVICE(cls, **overrides: Any) -> DeviceParameters:
        """One process, no parallelism (a world size above 1 is an error)."""
        return cls(dp_replicate=1, **overrides)

    @classmethod
    def DDP(cls, **overrides: Any) -> DeviceParameters:
        """Replicate the model on every rank and all-reduce gradients."""
        return cls(dp_replicate="auto", **overrides)

    @classmethod
    def FSDP(cls, **overrides: Any) -> DeviceParameters:
        """Shard parameters, gradients and optimizer state over every rank (FSDP2)."""
        return cls(dp_replicate=1, dp_shard="auto", **overrides)

    @classmethod
    def HSDP(cls, dp_shard: PositiveInt, **overrides: Any) -> DeviceParameters:
        """Shard within groups of ``dp_shard`` ranks and replicate across the groups."""
        return cls(dp_replicate="auto", dp_shard=dp_shard, **overrides)
