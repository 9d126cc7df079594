"""Hugging Face ``transformers`` mixture-of-experts blocks as ``MoE`` layers, weights included.

transformers 5 stores a sparse MoE block's experts stacked (Mixtral, Qwen3-MoE and the blocks
built like them): ``gate.weight`` is the router, ``[E, H]``; ``experts.gate_up_proj`` is
``[E, 2I, H]``, each expert's gate projection in its first ``I`` rows and its up projection in
the last ``I``, applied as ``F.linear``; ``experts.down_proj`` is ``[E, H, I]``. The mapping to
``MoE`` (whose expert matrices multiply from the right) is

- ``router.weight = gate.weight``
- ``experts.w1 = gate_up_proj[:, :I].transpose(1, 2)`` (gate), ``experts.w3 =
  gate_up_proj[:, I:].transpose(1, 2)`` (up), ``experts.w2 = down_proj.transpose(1, 2)``

with softmax scores, the block's ``top_k``, and ``normalize_scores`` from the router's
``norm_topk_prob`` (Mixtral, which has none, always normalizes). ``transformers`` is never
imported here: blocks are recognized by that layout.

Their files hold other keys: ``save_pretrained`` writes one tensor per expert and stacks them
only when it loads. Each converted layer of a known model type carries the ``ExpertFileLayout``
of its files (``HF_FILE_LAYOUT``), from which ``StackedKey`` rules map its stacked parameters
to those tensors and back (``init_weights_from`` and ``export_weights(format="hf")`` use them);
the same layout gives the rules of an unconverted block (``ExpertFileLayout.block_keys``), so
the model as transformers builds it loads and exports those files too.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from dream_trainer.nn.hf_router_outputs import attach_router_outputs
from dream_trainer.nn.moe import AuxLossScope, MoE

HF_FILE_LAYOUT = "hf_file_layout"
"""The attribute of an ``MoE`` layer made by ``replace_hf_moe_blocks`` that holds the
``ExpertFileLayout`` of its block's files (absent for a model type without a declared one)."""


@dataclass(frozen=True)
class StackedKey:
    """How files hold the model tensor ``key``: as the file tensors ``parts`` stacked along a
    new first dimension, or, when ``stacked`` is False, as the one tensor ``parts[0]``.

    Slice ``i`` of a stacked tensor is made of ``concat`` consecutive parts,
    ``parts[i * concat:(i + 1) * concat]``, each with its last two dimensions swapped when
    ``transposed``, joined along the slice's first dimension (transformers' ``gate_up_proj``
    joins each expert's gate and up projections so: ``concat=2``)."""

    key: str
    parts: tuple[str, ...]
    stacked: bool = True
    transposed: bool = False
    concat: int = 1

    def part_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """The shape of each file tensor of a stacked model tensor of ``shape``."""
        inner = (shape[1] // self.concat, *shape[2:])
        return (*inner[:-2], inner[-1], inner[-2]) if self.transposed else inner


@dataclass(frozen=True)
class ExpertFileLayout:
    """Where transformers' files keep an MoE block's weights: beside the block's module,
    under ``block`` (None: the module's own name), the router as ``gate.weight`` and expert
    ``e``'s gate, up and down projections as ``experts.<e>.<gate|up|down>.weight``, each an
    ``nn.Linear`` weight (``[out, in]``)."""

    block: str | None
    gate: str
    up: str
    down: str

    def _prefix(self, name: str) -> str:
        parent, _, own = name.rpartition(".")
        return ".".join(part for part in (parent, self.block or own) if part)

    def _experts(self, block: str, projection: str, num_experts: int) -> tuple[str, ...]:
        return tuple(f"{block}.experts.{expert}.{projection}.weight"
                     for expert in range(num_experts))

    def keys(self, name: str, num_experts: int) -> tuple[StackedKey, ...]:
        """The rules of the ``MoE`` layer called ``name`` (its key prefix) in the model."""
        block = self._prefix(name)
        return (StackedKey(f"{name}.router.weight", (f"{block}.gate.weight",), stacked=False),
                StackedKey(f"{name}.experts.w1", self._experts(block, self.gate, num_experts),
                           transposed=True),
                StackedKey(f"{name}.experts.w3", self._experts(block, self.up, num_experts),
                           transposed=True),
                StackedKey(f"{name}.experts.w2", self._experts(block, self.down, num_experts),
                           transposed=True))

    def block_keys(self, name: str, num_experts: int) -> tuple[StackedKey, ...]:
        """The rules of transformers' own block called ``name``, unconverted: its stacked
        ``experts.gate_up_proj`` (each expert's gate then up projection) and
        ``experts.down_proj`` from the same files, as transformers stacks them when it
        loads."""
        block = self._prefix(name)
        gate = self._experts(block, self.gate, num_experts)
        up = self._experts(block, self.up, num_experts)
        return (StackedKey(f"{name}.gate.weight", (f"{block}.gate.weight",), stacked=False),
                StackedKey(f"{name}.experts.gate_up_proj",
                           tuple(part for pair in zip(gate, up) for part in pair), concat=2),
                StackedKey(f"{name}.experts.down_proj",
                           self._experts(block, self.down, num_experts)))


FILE_LAYOUTS: dict[str, ExpertFileLayout] = {
    # transformers 5 keeps Mixtral's older module names in its files.
    "mixtral": ExpertFileLayout("block_sparse_moe", "w1", "w3", "w2"),
    "qwen3_moe": ExpertFileLayout(None, "gate_proj", "up_proj", "down_proj"),
}
"""The file layout of each transformers model type (``config.model_type``) whose MoE
blocks ``replace_hf_moe_blocks`` converts and whose files it can read and write."""


def is_hf_moe_block(module: nn.Module) -> bool:
    """True for a module with the stacked-experts layout above."""
    experts, gate = getattr(module, "experts", None), getattr(module, "gate", None)
    return isinstance(getattr(experts, "gate_up_proj", None), torch.Tensor) \
        and isinstance(getattr(experts, "down_proj", None), torch.Tensor) \
        and isinstance(getattr(gate, "weight", None), torch.Tensor)


def moe_from_hf(block: nn.Module, *, aux_loss_weight: float = 0.0,
                bias_update_rate: float | None = None,
                aux_loss_scope: AuxLossScope = "micro_batch") -> MoE:
    """An ``MoE`` that computes what ``block`` computes, holding copies of its weights (on
    their device, in their dtype), balancing its load as the keyword arguments say (``MoE``'s
    arguments of the same names; the defaults balance nothing).

    Raises:
        ValueError: if ``block`` does not have the stacked-experts layout, has a shared
            expert (Qwen2-MoE's gated shared expert is not ``MoE``'s), perturbs its inputs in
            training (Mixtral's ``router_jitter_noise``), or its experts' activation is not
            SiLU; or for balancing arguments ``MoE`` refuses.
    """
    if not is_hf_moe_block(block):
        raise ValueError(f"{type(block).__name__} is not a transformers MoE block with "
                         "gate.weight, experts.gate_up_proj and experts.down_proj")
    name = type(block).__name__
    if any(getattr(block, attribute, None) is not None
           for attribute in ("shared_expert", "shared_experts")):
        raise ValueError(f"{name} has a shared expert, which MoE does not reproduce: keep "
                         "the block, or convert only blocks without one")
    if getattr(block, "jitter_noise", 0):
        raise ValueError(f"{name} multiplies its inputs by random jitter in training "
                         "(router_jitter_noise > 0), which MoE does not: set it to 0")
    activation = type(getattr(block.experts, "act_fn", None)).__name__
    if "silu" not in activation.lower():
        raise ValueError(f"{name}'s experts use {activation}; MoE's experts are SwiGLU (SiLU)")
    gate_up, down = block.experts.gate_up_proj, block.experts.down_proj
    num_experts, hidden, dim = gate_up.shape[0], gate_up.shape[1] // 2, gate_up.shape[2]
    top_k = getattr(block, "top_k", None) or block.gate.top_k
    layer = MoE(dim, hidden, num_experts, top_k,
                normalize_scores=getattr(block.gate, "norm_topk_prob", True),
                aux_loss_weight=aux_loss_weight, bias_update_rate=bias_update_rate,
                aux_loss_scope=aux_loss_scope)
    # The weights take the block's dtype; the balancing buffers stay float32.
    layer.to(device=gate_up.device)
    for module in (layer.router, layer.experts):
        module.to(dtype=gate_up.dtype)
    with torch.no_grad():
        layer.router.weight.copy_(block.gate.weight)
        layer.experts.w1.copy_(gate_up[:, :hidden].transpose(1, 2))
        layer.experts.w3.copy_(gate_up[:, hidden:].transpose(1, 2))
        layer.experts.w2.copy_(down.transpose(1, 2))
    return layer


def replace_hf_moe_blocks(model: nn.Module, *, aux_loss_weight: float | None = None,
                          bias_update_rate: float | None = None,
                          aux_loss_scope: AuxLossScope = "micro_batch") -> list[str]:
    """Replace every transformers MoE block of ``model`` by the ``MoE`` of ``moe_from_hf``, in
    place; return the replaced modules' names. The model's outputs do not change (up to float
    rounding); its parameter names under each block do (``router.weight``, ``experts.w1`` ...).
    For a model type of ``FILE_LAYOUTS`` each new layer carries its files' layout
    (``HF_FILE_LAYOUT``), so that ``init_weights_from`` reads the files ``save_pretrained``
    wrote and ``export_weights(format="hf")`` writes them.

    The model's ``output_router_logits`` (the call's argument, else its config's) then returns
    the new layers' router logits and their auxiliary loss, added to ``loss`` when there is
    one (``attach_router_outputs``).

    Args:
        model: The model, changed in place.
        aux_loss_weight: Each layer's ``MoE.aux_loss_weight``; None reads the config: its
            ``router_aux_loss_coef`` when its ``output_router_logits`` is true, else 0.
        bias_update_rate: Each layer's ``MoE.bias_update_rate`` (None: no bias balancing).
        aux_loss_scope: Each layer's ``MoE.aux_loss_scope``.

    Raises:
        ValueError: as ``moe_from_hf``, for the first block it cannot convert (the model is
            then left unchanged).
    """
    config = getattr(model, "config", None)
    if aux_loss_weight is None:
        aux_loss_weight = float(getattr(config, "router_aux_loss_coef", 0.0) or 0.0) \
            if getattr(config, "output_router_logits", False) else 0.0
    found = [(name, module) for name, module in model.named_modules() if is_hf_moe_block(module)]
    # Every check before any change.
    layers = [moe_from_hf(module, aux_loss_weight=aux_loss_weight,
                          bias_update_rate=bias_update_rate, aux_loss_scope=aux_loss_scope)
              for _, module in found]
    layout = FILE_LAYOUTS.get(getattr(config, "model_type", None))
    for (name, _), layer in zip(found, layers):
        if layout is not None:
            setattr(layer, HF_FILE_LAYOUT, layout)
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name), child, layer)
    if layers and hasattr(config, "output_router_logits"):
        attach_router_outputs(model, layers)
    return [name for name, _ in found]
