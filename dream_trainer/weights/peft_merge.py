"""``export_weights(format="hf", merge_adapters=True)``: a peft model's base written with its
LoRA adapter merged into each adapted weight (``W + scaling * B @ A``, as peft's
``merge_and_unload`` computes it), under the base's own keys, from any layout.

``merged_models`` checks the models and gives the transformers model inside each, its LoRA
layers in place (under a pipeline, this rank's stages' bases as one ``PipelineStages``),
which the Hugging Face export writes as it writes any model (its ``config.json``, MoE
experts one tensor per expert, tied weights once); ``merged_state`` is what it writes of it:
the state dict with each LoRA layer's weight merged, sharded as the model is, and the
adapters left out. peft is never imported.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from dream_trainer.parallel.dtensor import full_value, is_dtensor
from dream_trainer.parallel.lora import is_peft_model
from dream_trainer.parallel.names import clean_name, unwrap_ddp
from dream_trainer.parallel.pipeline import PipelineStages, unwrap_stage
from dream_trainer.parallel.state_dict import model_state_dict
from dream_trainer.weights.hf import tied_groups
from dream_trainer.weights.peft_sources import ADAPTER_PART


_BY_PEFT = ("merge it with peft's merge_and_unload() on a copy of the trained model in one "
            "process")
"""The fix for what ``merged_models`` refuses to merge: peft's own merge."""

_NOT_MERGED = ("use_dora", "lora_bias", "modules_to_save", "trainable_token_indices",
               "target_parameters", "layer_replication", "alora_invocation_tokens",
               "use_qalora", "velora_config", "monteclora_config", "use_bdlora", "arrow_config",
               "kasa_config", "megatron_config")
"""``LoraConfig`` fields that change what a LoRA layer adds to its base's output, or train
weights besides the adapters: a merge of ``W + scaling * B @ A`` alone would drop them."""


def merged_models(models: Mapping[str, nn.Module], format: str) -> dict[str, nn.Module]:
    """The transformers model inside each peft model of ``models`` (its LoRA layers still in
    place), whose weights ``merged_state`` gives merged, for ``export_weights(format="hf",
    merge_adapters=True)``.

    Raises:
        ValueError: on every rank, naming the model and the fix, for a format other than
            ``"hf"``, a model that is not a peft model, several adapters, an adapter that is not plain LoRA (another peft type, or a config
            field of ``_NOT_MERGED`` set), or a LoRA layer that is not on a linear layer's
            weight or whose weight is tied to another.
    """
    if format != "hf":
        raise ValueError(f"merge_adapters=True writes the merged model in the Hugging Face "
                         f"layout, not format={format!r}: export format='hf' with it, or "
                         "format='peft' without it for the adapters alone")
    bases = {}
    for name, model in models.items():
        root = unwrap_ddp(model)
        # A pipeline rank holds stages, each a peft model holding some of the layers.
        stages = [unwrap_stage(stage) for stage in root.stages] \
            if isinstance(root, PipelineStages) else [root]
        if not is_peft_model(stages[0]):
            raise ValueError(f"merge_adapters=True merges the LoRA adapters of a peft model "
                             f"into its base, but the model {name!r} is a "
                             f"{type(stages[0]).__name__}: wrap it with peft.get_peft_model "
                             "in configure_models, or export without merge_adapters")
        if len(stages[0].peft_config) != 1:
            raise ValueError(f"merge_adapters=True merges one adapter, but the model {name!r} "
                             f"holds {sorted(stages[0].peft_config)}: delete the others "
                             "(model.delete_adapter) before exporting")
        (adapter, config), = stages[0].peft_config.items()
        _check_config(name, adapter, config)
        base = _base(stages[0])
        if isinstance(root, PipelineStages):
            # The stages' bases, presented as one model as the stages are (a container:
            # each base module stays where its stage holds it).
            prefix = next(key for key, module in stages[0].named_modules() if module is base)
            ties = [[key.removeprefix(f"{prefix}.") for key in group] for group in root.ties]
            base = PipelineStages([_base(stage) for stage in stages], root.stage_ids,
                                  root.num_stages, ties=ties)
        _check_layers(name, base, adapter)
        bases[name] = base
    return bases


def _base(peft_model: nn.Module) -> nn.Module:
    """The transformers model inside a ``PeftModel`` (or a ``LoraModel``)."""
    get_base = getattr(peft_model, "get_base_model", None)
    return get_base() if callable(get_base) else peft_model.model  # type: ignore[no-any-return]


def merged_state(model: nn.Module, dtype: torch.dtype | None = None) -> dict[str, Any]:
    """``model``'s state dict (a model ``merged_models`` gave) under its base's keys: each
    LoRA layer's base weight merged with its adapter, cast to ``dtype`` (None: the
    weight's own), its adapters left out. Collective under FSDP2 and TP: each LoRA layer's
    A and B are gathered whole, one layer at a time, and every merged weight keeps its
    sharding (a rank adds its slice of ``B @ A``).
    """
    state = model_state_dict(model)
    merged: dict[str, Any] = {}
    layers = _layers(model)
    for layer_name, (layer, adapter) in layers.items():
        key = f"{layer_name}.base_layer.weight"
        merged[key] = _merged_weight(state[key], layer, adapter, dtype)
    out: dict[str, Any] = {}
    for key, value in state.items():
        match = ADAPTER_PART.search(key)
        if match is not None and key[:match.start()] in layers:
            continue  # the adapter's own tensors
        head, found, tail = key.partition(".base_layer.")
        if found and head in layers:
            out[f"{head}.{tail}"] = merged.get(key, value)
        else:
            out[key] = value
    return out


def _merged_weight(weight: torch.Tensor, layer: nn.Module, adapter: str,
                   dtype: torch.dtype | None) -> torch.Tensor:
    """``weight + scaling * B @ A`` (transposed for a ``fan_in_fan_out`` layer), sharded as
    ``weight``. The sum is taken in the wider of the two dtypes (float32 for a bfloat16
    base with float32 adapters) and rounded once, to ``dtype`` or the weight's own."""
    weight = weight.detach()
    target = dtype or weight.dtype
    if adapter in getattr(layer, "merged_adapters", ()):  # peft's merge_adapter() did it
        return weight.to(target)
    with torch.no_grad():
        # A and B are r wide: whole on every rank they cost little, and each rank takes its
        # slice of the product without another collective.
        a = full_value(layer.lora_A[adapter].weight.detach())
        b = full_value(layer.lora_B[adapter].weight.detach())
        delta = (b @ a) * layer.scaling[adapter]
        if getattr(layer, "fan_in_fan_out", False):
            delta = delta.T
        wide = torch.promote_types(weight.dtype, delta.dtype)
        if is_dtensor(weight):
            from torch.distributed.tensor import distribute_tensor

            # Every rank holds the whole product: src_data_rank=None keeps its own slice,
            # placed as the weight's (FSDP2's and TP's shards alike), with no collective.
            delta = distribute_tensor(delta.to(wide), weight.device_mesh,  # type: ignore
                                      weight.placements, src_data_rank=None)  # type: ignore
        return (weight.to(wide) + delta.to(wide)).to(target)


def _layers(model: nn.Module) -> dict[str, tuple[nn.Module, str]]:
    """Name -> (LoRA layer, its adapter's name), for the layers of ``model`` holding one."""
    layers = {}
    for name, layer in model.named_modules():
        adapters = getattr(layer, "lora_A", None)
        if isinstance(adapters, nn.ModuleDict) and len(adapters) == 1:
            (adapter,) = adapters.keys()
            layers[clean_name(name)] = (layer, adapter)
    return layers


def _check_config(name: str, adapter: str, config: Any) -> None:
    kind = getattr(config, "peft_type", None)
    kind = getattr(kind, "value", kind)
    if kind != "LORA":
        raise ValueError(f"merge_adapters=True merges LoRA adapters, but the adapter "
                         f"{adapter!r} of the model {name!r} is a peft {kind} adapter: "
                         f"{_BY_PEFT}")
    used = [f"{field}={_shown(getattr(config, field))}" for field in _NOT_MERGED
            if getattr(config, field, None)]
    if used:
        raise ValueError(f"merge_adapters=True merges plain LoRA (W + scaling * B @ A), but "
                         f"the adapter {adapter!r} of the model {name!r} uses "
                         f"{', '.join(used)}, which it does not merge: {_BY_PEFT}, or train "
                         "without them")


def _shown(value: Any) -> str:
    return repr(sorted(value) if isinstance(value, (set, frozenset)) else value)


def _check_layers(name: str, base: nn.Module, adapter: str) -> None:
    """Refuse LoRA layers the merge cannot write under the base's keys."""
    tied = tied_groups(base)
    for layer_name, module in base.named_modules():
        layer_name = clean_name(layer_name)
        if adapter in getattr(module, "lora_embedding_A", {}):
            raise _unmergeable(name, layer_name, "nn.Embedding")
        if adapter not in getattr(module, "lora_A", {}):
            continue
        variant = getattr(module, "lora_variant", {}).get(adapter)
        if variant is not None:
            raise ValueError(f"the LoRA layer {layer_name} of the model {name!r} uses peft's "
                             f"{type(variant).__name__}, which adds more than scaling * B @ A "
                             f"to its weight: {_BY_PEFT}")
        weight = getattr(getattr(module, "base_layer", None), "weight", None)
        if not (isinstance(weight, torch.Tensor) and weight.dim() == 2
                and isinstance(module.lora_A[adapter], nn.Linear)
                and isinstance(module.lora_B[adapter], nn.Linear)):
            raise _unmergeable(name, layer_name,
                               type(getattr(module, "base_layer", module)).__name__)
        key = f"{layer_name}.base_layer.weight"
        if key in tied:
            other = next(k for k, group in tied.items() if group == tied[key] and k != key)
            raise ValueError(f"the LoRA layer {layer_name} of the model {name!r} adapts a "
                             f"weight tied to {other}: merged, the two would differ, and "
                             f"the export keeps one. Leave {layer_name} out of "
                             "target_modules, or untie them (tie_word_embeddings=False)")


def _unmergeable(name: str, layer: str, kind: str) -> ValueError:
    return ValueError(f"the LoRA layer {layer} of the model {name!r} adapts a {kind}: "
                      "merge_adapters=True merges LoRA on linear layers' weights only; leave "
                      f"{layer} out of the LoRA config, or export the adapter with "
                      "format='peft'")
