"""torchtitan's mixture-of-experts module as ``MoE`` layers, so that expert parallelism (and
everything else ``MoE`` does) reaches a model written with it.

torchtitan (0.2 and 0.3) builds its ``MoE`` from a token-choice router, ``router.gate``
(``nn.Linear(dim, E)``, its ``top_k``, ``score_func`` softmax or sigmoid, ``route_norm``,
``route_scale``), stacked SwiGLU experts stored as ``nn.Linear`` weights are, ``experts.w1``
and ``w3`` ``[E, hidden, dim]`` and ``w2`` ``[E, dim, hidden]``, optional ``shared_experts``
(a SwiGLU ``FeedForward`` of ``w1``/``w2``/``w3``), and the buffers ``expert_bias`` (its
auxiliary-loss-free balancing, moved by ``load_balance_coeff``) and ``tokens_per_expert``.
The mapping to ``MoE``, whose expert matrices multiply from the right, is

- ``router.weight = router.gate.weight``
- ``experts.w1 = w1.transpose(1, 2)``, ``experts.w2 = w2.transpose(1, 2)``,
  ``experts.w3 = w3.transpose(1, 2)``
- ``shared_experts`` and ``expert_bias`` under the same names,

with ``normalize_scores = route_norm``, ``route_scale``, and ``bias_update_rate =
load_balance_coeff``. torchtitan moves its bias by the same signs minus their mean; a shift of
every expert's bias by one amount changes no choice, so the two train alike. ``torchtitan`` is
never imported: the module is recognized by that layout. Files written from a torchtitan
model keep its names and shapes; ``dream_trainer.weights.torchtitan_moe_key`` maps them.
"""

from __future__ import annotations

import torch
from torch import nn

from dream_trainer.nn.moe import MoE


def is_torchtitan_moe(module: nn.Module) -> bool:
    """True for a module with torchtitan's MoE layout (``router.gate.weight`` and stacked
    ``experts.w1``/``w2``/``w3``)."""
    if isinstance(module, MoE):
        return False
    router, experts = getattr(module, "router", None), getattr(module, "experts", None)
    gate = getattr(router, "gate", None)
    return isinstance(getattr(gate, "weight", None), torch.Tensor) \
        and getattr(router, "top_k", None) is not None \
        and all(isinstance(getattr(experts, name, None), torch.Tensor)
                and getattr(experts, name).dim() == 3 for name in ("w1", "w2", "w3"))


def moe_from_torchtitan(module: nn.Module) -> MoE:
    """An ``MoE`` that computes what torchtitan's ``module`` computes, holding copies of its
    weights and balancing bias (on their device; the weights in their dtype).

    Raises:
        ValueError: naming what ``MoE`` does not reproduce, and the change that makes the
            module convertible: no torchtitan layout, a router with a bias
            (``gate_bias=True``), node-limited routing (``num_expert_groups``), the debug
            round-robin routing, scores applied before the experts
            (``score_before_experts=True``), or shared experts whose width is not a multiple
            of the routed experts'.
    """
    name = type(module).__name__
    if not is_torchtitan_moe(module):
        raise ValueError(f"{name} is not torchtitan's MoE: it needs router.gate.weight, "
                         "router.top_k and 3-dimensional experts.w1, w2 and w3")
    router, experts = module.router, module.experts
    refusals = [
        (getattr(router.gate, "bias", None) is not None,
         "its router's gate has a bias (gate_bias=True), which MoE's router has not"),
        (getattr(router, "num_expert_groups", None) is not None,
         "it routes within groups of experts (num_expert_groups), which MoE does not: set "
         "num_expert_groups=None"),
        (bool(getattr(router, "_debug_force_load_balance", False)),
         "it routes round-robin for debugging (_debug_force_load_balance): turn it off"),
        (bool(getattr(module, "score_before_experts", False)),
         "it scales the experts' inputs by the router's scores (score_before_experts=True); "
         "MoE scales their outputs, which differs through the SiLU: keep the module (it "
         "trains as it is, without expert parallelism), or build it with "
         "score_before_experts=False (DeepSeek-V3's setting)"),
    ]
    for refused, reason in refusals:
        if refused:
            raise ValueError(f"{name} cannot become an MoE: {reason}")
    num_experts, hidden, dim = experts.w1.shape
    shared = getattr(module, "shared_experts", None)
    num_shared = 0
    if shared is not None:
        width = shared.w1.weight.shape[0]
        if any(getattr(shared, part).bias is not None for part in ("w1", "w2", "w3")):
            raise ValueError(f"{name} cannot become an MoE: its shared experts have biases, "
                             "which MoE's have not")
        if width % hidden:
            raise ValueError(f"{name} cannot become an MoE: its shared experts are {width} "
                             f"wide, not a multiple of the routed experts' {hidden} as MoE's "
                             "are (num_shared_experts x hidden_dim)")
        num_shared = width // hidden
    rate = getattr(module, "load_balance_coeff", None)
    layer = MoE(dim, hidden, num_experts, int(router.top_k), score_func=router.score_func,
                normalize_scores=bool(router.route_norm),
                route_scale=float(router.route_scale), num_shared_experts=num_shared,
                bias_update_rate=rate)
    layer.to(device=experts.w1.device)
    for part in (layer.router, layer.experts, layer.shared_experts):
        if part is not None:
            part.to(dtype=experts.w1.dtype)
    with torch.no_grad():
        layer.router.weight.copy_(router.gate.weight)
        for weight in ("w1", "w2", "w3"):
            getattr(layer.experts, weight).copy_(getattr(experts, weight).transpose(1, 2))
            if shared is not None:
                getattr(layer.shared_experts, weight).weight.copy_(
                    getattr(shared, weight).weight)
        if rate is not None and isinstance(getattr(module, "expert_bias", None), torch.Tensor):
            layer.expert_bias.copy_(module.expert_bias)
    return layer


def replace_torchtitan_moe_blocks(model: nn.Module) -> list[str]:
    """Replace every torchtitan MoE module of ``model`` by the ``MoE`` of
    ``moe_from_torchtitan``, in place; return the replaced modules' names. The model's
    outputs do not change (up to float rounding); the keys under each module do:
    ``router.gate.weight`` becomes ``router.weight`` and the experts are stored transposed
    (``torchtitan_moe_key`` maps torchtitan's files to them and back).

    Raises:
        ValueError: as ``moe_from_torchtitan``, for the first module it cannot convert (the
            model is then left unchanged).
    """
    found = [(name, module) for name, module in model.named_modules()
             if is_torchtitan_moe(module)]
    layers = [moe_from_torchtitan(module) for _, module in found]  # every check first
    for (name, _), layer in zip(found, layers):
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name), child, layer)
    return [name for name, _ in found]
