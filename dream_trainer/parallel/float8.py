"""float8 training through torchao: which Linear layers convert, and converting them.

torchao is an optional extra (``[float8]``), imported only when a run sets
``DeviceParameters.float8_recipe``. Conversion swaps ``nn.Linear`` for torchao's
``Float8Linear`` on the meta device, before tensor parallelism, activation checkpointing,
compilation and FSDP2: the swapped module keeps the same ``weight``/``bias`` parameters, so
state-dict keys and checkpoints are those of the high-precision model.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import sys
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

logger = logging.getLogger(__name__)

EXTRA = "float8"
FLOAT8_ALIGNMENT = 16
"""float8 matmuls (``torch._scaled_mm``) need both dimensions of a weight to be multiples
of this; other Linear layers stay in high precision."""
_FLOAT8_CAPABILITY = (8, 9)  # Ada and Hopper onwards have float8 tensor cores


def import_float8() -> Any:
    """``torchao.float8``, or an ImportError that names the extra to install."""
    try:
        from torchao import float8
    except ImportError as exc:
        raise ImportError(f"DeviceParameters.float8_recipe needs torchao: pip install "
                          f"'dream-trainer[{EXTRA}]'") from exc
    return float8


def needs_emulation(device: torch.device) -> bool:
    """True where the hardware has no float8 matmul: the CPU, or CUDA capability < 8.9."""
    if device.type != "cuda":
        return True
    return torch.cuda.get_device_capability(device) < _FLOAT8_CAPABILITY


def filtered(fqn: str, filter_names: Sequence[str]) -> bool:
    """True when an entry of ``filter_names`` is a run of whole components of ``fqn``:
    ``"head"`` matches ``head``, ``model.head`` and every module under them."""
    return any(f".{name}." in f".{fqn}." for name in filter_names)


def converts(module: nn.Module, fqn: str, filter_names: Sequence[str]) -> bool:
    """Whether ``module`` (named ``fqn`` in its model) trains in float8: a ``nn.Linear``
    outside ``filter_names`` whose features are both multiples of 16."""
    if not isinstance(module, nn.Linear):
        return False
    aligned = module.in_features % FLOAT8_ALIGNMENT == 0 \
        and module.out_features % FLOAT8_ALIGNMENT == 0
    return aligned and not filtered(fqn, filter_names)


def convert_to_float8(model: nn.Module, recipe: str, filter_names: Sequence[str],
                      device: torch.device, fsdp_float8_all_gather: bool) -> list[str]:
    """Swap ``model``'s eligible Linear layers for torchao's ``Float8Linear``, in place.

    Args:
        model: The model (on the meta device, before any parallelism is applied).
        recipe: ``DeviceParameters.float8_recipe``.
        filter_names: ``DeviceParameters.float8_filter``.
        device: Where the model will run; float8 is emulated where it has no float8 matmul.
        fsdp_float8_all_gather: All-gather the weights in float8 under FSDP2 (tensorwise
            scaling only).

    Returns:
        The names of the converted layers.

    Raises:
        ImportError: when torchao is not installed.
        TypeError: if ``model`` is itself a Linear layer (there is no parent to swap it in).
    """
    float8 = import_float8()
    if isinstance(model, nn.Linear):
        raise TypeError("float8_recipe converts the Linear layers inside a model, but the "
                        "model is itself an nn.Linear: wrap it in a module")
    emulate = needs_emulation(device)
    if emulate:
        _log_emulation(device.type)
    config = dataclasses.replace(float8.Float8LinearConfig.from_recipe_name(recipe),
                                 emulate=emulate,
                                 enable_fsdp_float8_all_gather=fsdp_float8_all_gather)
    converted = [fqn for fqn, module in model.named_modules()
                 if converts(module, fqn, filter_names)]
    float8.convert_to_float8_training(
        model, config=config,
        module_filter_fn=lambda module, fqn: converts(module, fqn, filter_names))
    return converted


def float8_tensor_parallel_styles(model: nn.Module) -> tuple[type, type, type]:
    """``(ColwiseParallel, RowwiseParallel, PrepareModuleInput)`` for ``model``'s
    tensor-parallel plan: torchao's float8 styles when its Linear layers were converted with
    tensorwise scaling (they cast activations to float8 before the tensor-parallel
    collectives, so those move 1 byte per element), torch's otherwise.

    Use in ``apply_tensor_parallel``, which runs after the conversion.
    """
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
    )

    # Only a converted model has torchao loaded; a plain one must not import it.
    float8_linear = sys.modules.get("torchao.float8.float8_linear")
    tensorwise = float8_linear is not None and any(
        isinstance(module, float8_linear.Float8Linear)
        and module.config.cast_config_input.scaling_granularity.value == "tensorwise"
        for module in model.modules())
    if not tensorwise:
        return ColwiseParallel, RowwiseParallel, PrepareModuleInput
    from torchao.float8.float8_tensor_parallel import (
        Float8ColwiseParallel,
        Float8RowwiseParallel,
        PrepareFloat8ModuleInput,
    )

    return Float8ColwiseParallel, Float8RowwiseParallel, PrepareFloat8ModuleInput


@functools.cache
def _log_emulation(device_type: str) -> None:
    logger.warning("float8 training is emulated on %s (no float8 matmul in this hardware: "
                   "float8 needs CUDA capability 8.9 or higher): the numerics are float8's, "
                   "the speed is not", device_type)
