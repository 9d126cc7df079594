"""Low-precision routed experts through torchao's MoE training path.

torchao (0.18, ``torchao.prototype.moe_training``) wraps a stacked expert weight in a tensor
subclass whose grouped matrix products (``torch._grouped_mm`` with ``offs``) quantize both
operands on the fly: float8 with a scale per row (``Float8TrainingOpConfig``, torch's
``_scaled_grouped_mm``, CUDA capability 9.0 or higher), or MXFP8 (a scale per 32 elements;
an emulated kernel runs anywhere, slowly). The parameters stay ``GroupedExperts``' own, in
their dtype, so checkpoints and exports do not change.

``DeviceParameters.float8_recipe`` converts the experts where the float8 kernel exists; on
other hardware they stay in the parameters' dtype (logged), since torchao has no float8
emulation for grouped products: float8 there covers the dense ``nn.Linear`` layers only.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

from dream_trainer.nn.moe import GroupedExperts

logger = logging.getLogger(__name__)

_GROUPED_FLOAT8_CAPABILITY = (9, 0)  # torch._scaled_grouped_mm: Hopper onwards


def expert_float8_config(device: torch.device) -> Any | None:
    """torchao's float8 (rowwise) config for the experts on ``device``, or None where its
    grouped float8 kernel does not run (the CPU, CUDA capability below 9.0)."""
    if device.type != "cuda" or torch.cuda.get_device_capability(device) \
            < _GROUPED_FLOAT8_CAPABILITY:
        return None
    from torchao.prototype.moe_training.config import Float8TrainingOpConfig

    return Float8TrainingOpConfig()


def convert_experts(model: nn.Module, config: Any) -> list[str]:
    """Wrap the weights of every ``GroupedExperts`` in ``model`` for torchao's low-precision
    grouped products under ``config`` (a ``torchao.prototype.moe_training`` config), in
    place; returns the names of the converted modules.

    Raises:
        ImportError: when torchao is not installed.
    """
    from torchao.quantization import quantize_

    converted = {name: module for name, module in model.named_modules()
                 if isinstance(module, GroupedExperts)}
    if converted:
        quantize_(model, config, filter_fn=lambda module, fqn: isinstance(module,
                                                                          GroupedExperts))
        for module in converted.values():
            module.register_state_dict_post_hook(_unwrapped)
    return list(converted)


def _unwrapped(module: nn.Module, state: dict[str, Any], prefix: str, local: Any) -> None:
    """Save the wrapped weights as the plain tensors they hold (same storage), so that
    checkpoints are those of the high-precision model and load into it, converted or not
    (``load_state_dict`` copies into the wrapper)."""
    for key, value in state.items():
        if key.startswith(prefix) and hasattr(value, "_data"):
            state[key] = value._data
        elif key.startswith(prefix) and hasattr(value, "to_local"):
            inner = value.to_local()
            if hasattr(inner, "_data"):
                from torch.distributed.tensor import DTensor

                state[key] = DTensor.from_local(inner._data, value.device_mesh,
                                                value.placements, shape=value.shape,
                                                stride=value.stride())


def convert_experts_to_float8(model: nn.Module, device: torch.device) -> list[str]:
    """What ``float8_recipe`` does to ``model``'s routed experts on ``device``: converted to
    float8 where the kernel exists, else left alone and said once."""
    experts = [name for name, module in model.named_modules()
               if isinstance(module, GroupedExperts)]
    if not experts:
        return []
    config = expert_float8_config(device)
    if config is None:
        logger.info("float8_recipe: the %d routed expert modules stay in the parameters' "
                    "dtype on %s (torchao's float8 grouped products need CUDA capability "
                    "9.0 or higher)", len(experts), device.type)
        return []
    return convert_experts(model, config)
