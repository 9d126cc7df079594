"""Pipeline stages of Hugging Face ``transformers`` decoders (Llama, Qwen2/3, Mistral and any
causal LM built the same way).

Such a model is ``XForCausalLM(model=XModel(embed_tokens, layers, norm, rotary_emb),
lm_head)``. Its ``forward`` iterates every layer and calls the embedding, the rotary
embedding and the final norm unconditionally, so the default split's convention (``forward``
skips None modules) does not hold. ``split_hf_decoder`` splits it as ``split_model`` does
(embedding on the first stage, the layers evenly, norm and head on the last; parameter names
unchanged) and gives each stage a ``forward`` that runs the library's own decoder ``forward``
(its rotary embeddings, its causal or sliding-window masks) with a pass-through standing in
for every module another stage runs. Modules without parameters (the rotary embedding) are
kept on every stage, since every stage needs what they compute.

A peft model wrapping such a decoder (``PeftModel`` -> tuner -> ``XForCausalLM``) splits the
same way: its LoRA adapters live inside the decoder's layers and go with them, parameter names
keep peft's prefix (``base_model.model.model.layers.0...``), and each stage runs the decoder
inside it.

Neither ``transformers`` nor peft is imported here (see ``hf_init`` and ``lora``).
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import nn

from dream_trainer.parallel.hf_init import is_hf_model
from dream_trainer.parallel.lora import is_peft_model
from dream_trainer.parallel.pipeline import split_model

_STAGE_CLASSES: dict[type, type] = {}


def is_hf_decoder(model: nn.Module) -> bool:
    """True for a ``transformers`` model whose base model holds its layers in ``layers`` (a
    ``ModuleList``) and that has an input embedding, or a peft model wrapping one: the
    decoders ``split_hf_decoder`` splits."""
    decoder = _decoder(model)
    if not is_hf_model(decoder):
        return False
    inner = _base_model(decoder)
    return inner is not decoder and isinstance(getattr(inner, "layers", None), nn.ModuleList) \
        and isinstance(getattr(inner, "embed_tokens", None), nn.Module)


def split_pipeline(model: nn.Module, stage_ids: Sequence[int],
                   num_stages: int) -> list[nn.Module]:
    """The default split: ``split_hf_decoder`` for a ``transformers`` decoder, else
    ``split_model``."""
    split = split_hf_decoder if is_hf_decoder(model) else split_model
    return split(model, stage_ids, num_stages)


def split_hf_decoder(model: nn.Module, stage_ids: Sequence[int],
                     num_stages: int) -> list[nn.Module]:
    """Split a ``transformers`` decoder into pipeline stages; return the ones in ``stage_ids``.

    The first stage takes token ids and returns hidden states, middle stages take and return
    hidden states, the last returns the logits (``lm_head``'s output, a tensor, not the
    model's output object). Attention masks come from the model's own mask functions for
    unpadded sequences: pipelined batches carry no ``attention_mask`` (mark padding in the
    labels, with -100, instead). A peft model's stages are peft models holding a part of
    the decoder, under peft's parameter names.

    Raises:
        ValueError: as ``split_model`` does, for a model ``is_hf_decoder`` rejects, or for
            a peft model with prompt-learning adapters.
    """
    if not is_hf_decoder(model):
        raise ValueError(f"{type(model).__name__} is not a transformers decoder with "
                         "model.layers and model.embed_tokens: override "
                         "apply_pipeline_parallel(pp_mesh)")
    _refuse_prompt_learning(model)
    everywhere = {name: child for name, child in _base_model(_decoder(model)).named_children()
                  if not any(True for _ in child.parameters())}
    stages = split_model(model, stage_ids, num_stages)
    for stage in stages:
        inner = _base_model(_decoder(stage))
        for name, child in everywhere.items():
            if inner._modules.get(name) is None:
                setattr(inner, name, copy.deepcopy(child))
        stage.__class__ = _stage_class(type(stage))
    return stages


def _decoder(model: nn.Module) -> nn.Module:
    """The ``transformers`` model a peft model wraps (``PeftModel.base_model`` is the tuner,
    whose ``model`` it is), or ``model`` itself."""
    # Registered children only: both peft classes forward unknown attributes to the model
    # they wrap, and a transformers model's own ``base_model`` is its inner ``XModel``.
    while is_peft_model(model):
        inner = model._modules.get("base_model", model._modules.get("model"))
        if not isinstance(inner, nn.Module):
            break
        model = inner
    return model


def _refuse_prompt_learning(model: nn.Module) -> None:
    """Prompt-learning adapters (prompt or prefix tuning) add their tokens in
    ``PeftModel.forward``, which a stage does not run: it would train without them."""
    configs = getattr(model, "peft_config", {}) if is_peft_model(model) else {}
    learned = sorted(name for name, config in configs.items()
                     if getattr(config, "is_prompt_learning", False))
    if learned:
        raise ValueError(
            f"the peft adapters {learned} of {type(model).__name__} learn prompt tokens, which "
            "PeftModel.forward adds before the decoder runs, but a pipeline's stages run the "
            "decoder's layers alone: use adapters inside the layers (LoRA) under "
            "pipeline_parallel, or override apply_pipeline_parallel(pp_mesh)")


def _base_model(model: nn.Module) -> nn.Module:
    prefix = getattr(model, "base_model_prefix", "")
    inner = getattr(model, prefix, None) if prefix else None
    return inner if isinstance(inner, nn.Module) else model


def _stage_class(model_class: type) -> type:
    """``model_class`` with the stage ``forward`` (one subclass per model class)."""
    if model_class not in _STAGE_CLASSES:
        _STAGE_CLASSES[model_class] = type(model_class.__name__, (model_class,),
                                           {"forward": _stage_forward,
                                            "__module__": model_class.__module__})
    return _STAGE_CLASSES[model_class]


def _stage_forward(self: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """Token ids (first stage) or hidden states in; hidden states or logits (last) out.

    A peft stage runs its decoder directly: what ``PeftModel.forward`` adds around it
    (per-sample adapter names, prompt-learning tokens) needs arguments a stage never gets,
    and the LoRA layers apply their active adapters inside the decoder's own forward.
    """
    decoder = _decoder(self)
    inner = _base_model(decoder)
    first = inner._modules.get("embed_tokens") is not None
    with _standing_in(inner):
        inputs = {"input_ids": hidden} if first else {"inputs_embeds": hidden}
        output = inner(**inputs, use_cache=False)
    hidden = output[0]
    head = decoder._modules.get("lm_head")
    return hidden if head is None else head(hidden)


class _PassThrough(nn.Module):
    """Stands for a module another stage runs: returns its first input unchanged."""

    def forward(self, hidden: Any, *args: Any, **kwargs: Any) -> Any:
        return hidden


@contextlib.contextmanager
def _standing_in(inner: nn.Module) -> Iterator[None]:
    """Put a pass-through in every empty place of ``inner`` and its layer list for the call."""
    places = [(module, name) for module in (inner, inner.layers)
              for name, child in module._modules.items() if child is None]
    through = _PassThrough()
    for module, name in places:
        module._modules[name] = through
    try:
        yield
    finally:
        for module, name in places:
            module._modules[name] = None
