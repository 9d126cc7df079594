"""Mixed precision outside FSDP2: autocast for the steps and a scaler for float16."""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from dream_trainer.configs.device import DeviceParameters
from dream_trainer.parallel.data_parallel import DataParallelBackend


class Precision:
    """How the steps run and gradients are scaled for the configured ``param_dtype``.

    FSDP2 casts parameters itself (``MixedPrecisionPolicy``), so autocast is used only for
    unsharded models. float16 needs loss scaling against underflow; bfloat16 does not.
    """

    def __init__(self, params: DeviceParameters, data_parallel: DataParallelBackend,
                 device: torch.device) -> None:
        low = params.param_dtype != torch.float32
        self.device_type = device.type
        self.autocast_dtype = params.param_dtype if low and not data_parallel.shards else None
        self.scaler: torch.amp.GradScaler | None = None
        if params.param_dtype == torch.float16:
            if data_parallel.shards:
                from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

                self.scaler = ShardedGradScaler(device.type)
            else:
                self.scaler = torch.amp.GradScaler(device.type)
        self._pending_update = False

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        """The context the training and validation steps run in."""
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device_type, dtype=self.autocast_dtype)

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        return loss if self.scaler is None else self.scaler.scale(loss)

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Bring gradients back to their true scale before they are measured or clipped."""
        if self.scaler is not None:
            self.scaler.unscale_(optimizer)
            self._pending_update = True

    def overflowed(self, optimizer: torch.optim.Optimizer) -> bool:
        """After ``unscale_``: whether the float16 gradients hold an inf or NaN (the vote's
        float16 cause). A host sync, the one the scaler's own step would make."""
        if self.scaler is None:
            return False
        # What GradScaler.step reads to decide the same; torch keeps it per optimizer.
        found = self.scaler._per_optimizer_states[id(optimizer)]["found_inf_per_device"]
        return bool(sum(float(value.item()) for value in found.values()))

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        """Step ``optimizer`` (through the scaler with float16)."""
        if self.scaler is None:
            optimizer.step()
        else:
            self.scaler.step(optimizer)

    def update(self) -> None:
        """Adjust the loss scale once per optimizer step, after its vote: lowered when the
        gradients overflowed (the vote skipped the update), raised after enough good steps."""
        if self.scaler is None or not self._pending_update:
            return
        self.scaler.update()
        self._pending_update = False

    def state_dict(self) -> dict[str, Any]:
        return {} if self.scaler is None else {"scaler": self.scaler.state_dict()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if self.scaler is not None and "scaler" in state_dict:
            self.scaler.load_state_dict(state_dict["scaler"])
