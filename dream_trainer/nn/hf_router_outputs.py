"""``output_router_logits`` for a transformers MoE model whose blocks became ``MoE`` layers.

transformers collects each block's router logits with hooks on its router class and, when
``output_router_logits`` is set (the call's argument, else the config's), its causal LM adds
``router_aux_loss_coef`` times its load-balancing loss of those logits to ``loss``. Once the
blocks are ``MoE`` layers there is no router of that class left: the tuple comes back empty
and transformers' loss fails on it (``IndexError``). ``attach_router_outputs`` takes over the
flag: the model runs with ``output_router_logits=False``, and its output then gets the
``MoE`` layers' router logits and their auxiliary loss (``MoE.aux_loss``), added to ``loss``
when there is one.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from dream_trainer.nn.moe import MoE

FLAG = "output_router_logits"


class _RouterOutputs:
    """The state of one model's calls: the logits and layers of the call in progress (None
    when no call asked for them)."""

    def __init__(self) -> None:
        self.logits: list[torch.Tensor] | None = None
        self.layers: list[MoE] = []

    def record(self, layer: MoE, router: nn.Module, args: Any, output: torch.Tensor) -> None:
        # A recomputation in backward (activation checkpointing) runs after the call: None.
        if self.logits is not None:
            self.logits.append(output)
            self.layers.append(layer)

    def before(self, model: nn.Module, args: tuple[Any, ...],
               kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
        if not _takes_flag(type(model)):  # a pipeline stage's forward, say
            return None
        wanted = kwargs.get(FLAG)
        if wanted is None:
            wanted = getattr(getattr(model, "config", None), FLAG, False)
        if not wanted:
            return None
        self.logits, self.layers = [], []
        return args, {**kwargs, FLAG: False}

    def after(self, model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
              output: Any) -> Any:
        logits, layers = self.logits, self.layers
        self.logits, self.layers = None, []
        if logits is None or output is None:  # not asked, or the call failed
            return None
        if not isinstance(output, Mapping):
            raise TypeError(f"{type(model).__name__} was called with {FLAG}=True and "
                            "return_dict=False: its MoE layers' router logits and auxiliary "
                            "loss go into the output object's router_logits and aux_loss; "
                            "call it with return_dict=True")
        aux_loss = torch.stack([layer.aux_loss for layer in layers]).sum() if layers \
            else torch.zeros((), device=next(model.parameters()).device)
        output.router_logits = tuple(logits)
        output.aux_loss = aux_loss
        if output.get("loss") is not None:
            output.loss = output["loss"] + aux_loss.to(output["loss"].device)
        return output


def attach_router_outputs(model: nn.Module, layers: Sequence[MoE]) -> None:
    """Make ``model`` (a transformers MoE model) answer ``output_router_logits`` with its
    ``layers``: when the call's argument, else the config's ``output_router_logits``, is
    true, the output's ``router_logits`` is the tuple of the logits each layer's router
    computed in the call (``[tokens, num_experts]``, in the order the layers ran, as
    transformers returns them), its ``aux_loss`` the sum of those layers' ``aux_loss``
    (each already multiplied by its ``aux_loss_weight``; 0 when that is 0), and ``loss``
    (present when ``labels`` were given) includes ``aux_loss``. Nothing runs in a call that
    does not ask (the layers' router hooks only check a flag).
    """
    outputs = _RouterOutputs()
    for layer in layers:
        layer.router.register_forward_hook(functools.partial(outputs.record, layer))
    model.register_forward_pre_hook(outputs.before, with_kwargs=True)
    model.register_forward_hook(outputs.after, with_kwargs=True, always_call=True)


@functools.lru_cache(maxsize=None)
def _takes_flag(model_class: type) -> bool:
    return FLAG in inspect.signature(model_class.forward).parameters
