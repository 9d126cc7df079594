"""Mixed precision outside FSDP2: autocast for the steps and a scaler for float16."""

from __future__ import annotations

import contextlib
import logging
from typing import Any

import torch

from dream_trainer.configs.device import DeviceParameters
from dream_trainer.world.dims import ParallelDims

logger = logging.getLogger(__name__)


class Precision:
    """How the steps run and gradients are scaled for the configured ``param_dtype``.

    FSDP2 casts parameters itself (``MixedPrecisionPolicy``), so autocast is used only for
    unsharded models. float16 needs loss scaling against underflow; bfloat16 does not.
    """

    def __init__(self, params: DeviceParameters, dims: ParallelDims,
                 device: torch.device) -> None:
        low = params.param_dtype != torch.float32
        self.device_type = device.type
        self.autocast_dtype = params.param_dtype if low and dims.dp_shard == 1 else None
        self.scaler: torch.amp.GradScaler | None = None
        if params.param_dtype == torch.float16:
            if dims.dp_shard > 1:
                from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

                self.scaler = ShardedGradScaler(device.type)
            else:
                self.scaler = torch.amp.GradScaler(device.type)
        self.skipped_steps = 0
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

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        """Step ``optimizer``; with a scaler, a step with non-finite gradients is skipped."""
        if self.scaler is None:
            optimizer.step()
            return
        self.scaler.step(optimizer)
        self._pending_update = True

    def update(self) -> None:
        """Adjust the loss scale once per optimizer-step window, after every step in it.

        The scaler lowers the scale exactly when it skipped a step for inf/NaN gradients.
        """
        if self.scaler is None or not self._pending_update:
            return
        before = self.scaler.get_scale()
        self.scaler.update()
        self._pending_update = False
        if self.scaler.get_scale() < before:
            self.skipped_steps += 1
            logger.warning("float16 gradients overflowed at loss scale %g: the optimizer "
                           "step was skipped (%d so far)", before, self.skipped_steps)

    def state_dict(self) -> dict[str, Any]:
        return {} if self.scaler is None else {"scaler": self.scaler.state_dict()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if self.scaler is not None and "scaler" in state_dict:
            self.scaler.load_state_dict(state_dict["scaler"])
