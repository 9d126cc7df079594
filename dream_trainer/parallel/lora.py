"""LoRA adapters of peft models under dream_trainer's build: their initialization on the meta
device.

``get_peft_model`` initializes each adapter when it adds it (``LoraLayer.update_layer``): A
as ``nn.Linear`` would be (or Gaussian), B at zero, so the wrapped model starts as the base.
On the meta device that draw is lost, and materialization's ``reset_parameters()`` (and a
transformers model's own initialization) would give B random values instead. This runs
peft's own ``reset_lora_parameters`` again on every adapter, with the ``init_lora_weights``
of its config, after those: B is zero again. The schemes that compute the adapters from the
base's weights (PiSSA, OLoRA, LoftQ, ...) need values the meta device does not have and are
refused, naming the adapter.

peft is never imported here: its models are recognized by their package.
"""

from __future__ import annotations

from typing import Any

from torch import nn

_DRAWN = (True, False, "gaussian")
"""The ``init_lora_weights`` values that need no base weights."""


def is_peft_model(module: nn.Module) -> bool:
    """A peft model (``PeftModel`` or a tuner model holding ``peft_config``)."""
    return any(kind.__module__.startswith("peft.") for kind in type(module).__mro__) \
        and isinstance(getattr(module, "peft_config", None), dict)


def init_peft_adapters(module: nn.Module) -> int:
    """Initialize every LoRA adapter inside the peft models of ``module`` as peft does;
    return how many adapter layers were initialized.

    Raises:
        ValueError: for an adapter whose ``init_lora_weights`` computes it from the base's
            weights, naming the adapter and the fix.
    """
    count = 0
    for model in _outermost_peft_models(module):
        configs: dict[str, Any] = model.peft_config
        for name, layer in model.named_modules():
            adapters = getattr(layer, "lora_A", None)
            if not (callable(getattr(layer, "reset_lora_parameters", None))
                    and isinstance(adapters, nn.ModuleDict)):
                continue
            for adapter in adapters.keys():
                init = getattr(configs.get(adapter), "init_lora_weights", True)
                if init not in _DRAWN:
                    raise ValueError(
                        f"the LoRA adapter {adapter!r} of {name} is initialized with "
                        f"init_lora_weights={init!r}, which computes it from the base's weights: "
                        "a model built on the meta device has none then. Use "
                        "init_lora_weights=True or 'gaussian', or load the initialized adapter "
                        "with init_weights_from")
                layer.reset_lora_parameters(adapter, init)
            count += 1
    return count


def lora_tensor_parallel_plan(module: nn.Module, plan: dict[str, Any]) -> dict[str, Any]:
    """``plan`` (a ``parallelize_module`` plan over ``module``) with every entry that names a
    LoRA layer split over its parts: the base layer takes the entry's style, and the adapters
    follow it so that their output adds to the base's shard for shard. Column-parallel: A
    replicated (it reads the whole input), B column-parallel. Row-parallel: A row-parallel
    (it reads the input's shard; its output is summed over the ranks), B replicated.

    Raises:
        ValueError: naming the entry, for a LoRA layer under a style that is neither.
    """
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    expanded: dict[str, Any] = {}
    for name, style in plan.items():
        layer = module.get_submodule(name)
        base = getattr(layer, "base_layer", None)
        adapters = getattr(layer, "lora_A", None)
        if not (isinstance(base, nn.Module) and isinstance(adapters, nn.ModuleDict)):
            expanded[name] = style
            continue
        expanded[f"{name}.base_layer"] = style
        for adapter in adapters.keys():
            if isinstance(style, ColwiseParallel):
                expanded[f"{name}.lora_B.{adapter}"] = ColwiseParallel()
            elif isinstance(style, RowwiseParallel):
                expanded[f"{name}.lora_A.{adapter}"] = RowwiseParallel()
            else:
                raise ValueError(
                    f"{name} is a LoRA layer under {type(style).__name__}: its adapters can "
                    "follow ColwiseParallel or RowwiseParallel only; give its base one of "
                    "them, or leave the layer out of the plan")
    return expanded


def _outermost_peft_models(module: nn.Module) -> list[nn.Module]:
    found: list[nn.Module] = []
    for candidate in module.modules():
        if is_peft_model(candidate) and not any(candidate in outer.modules() for outer in found):
            found.append(candidate)
    return found
