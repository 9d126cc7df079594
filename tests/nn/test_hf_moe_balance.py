"""Balancing in transformers MoE models converted by ``replace_hf_moe_blocks``: its keyword
arguments and their defaults from the config, ``output_router_logits`` answered with the
``MoE`` layers' router logits and auxiliary loss (added to ``loss``), and a converted model
that trains with the balancing bias and the auxiliary loss on."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

from dream_trainer.configs import TrainingParameters
from dream_trainer.nn import MoE, replace_hf_moe_blocks
from tests.helpers.hf import HFTrainer, hf_config, qwen3_moe_config
from tests.helpers.tolerance import assert_close_to_scale

TOKENS = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))


def model(**config: Any) -> Qwen3MoeForCausalLM:
    torch.manual_seed(0)
    return Qwen3MoeForCausalLM(Qwen3MoeConfig(**{**qwen3_moe_config(layers=2).to_dict(),
                                                 **config}))


def layers(converted: torch.nn.Module) -> list[MoE]:
    return [module for module in converted.modules() if isinstance(module, MoE)]


def test_balancing_defaults_come_from_the_config() -> None:
    # transformers adds router_aux_loss_coef x its loss only with output_router_logits.
    on = model(output_router_logits=True, router_aux_loss_coef=0.02)
    replace_hf_moe_blocks(on)
    assert [(layer.aux_loss_weight, layer.bias_update_rate, layer.aux_loss_scope)
            for layer in layers(on)] == [(0.02, None, "micro_batch")] * 2
    off = model(output_router_logits=False, router_aux_loss_coef=0.02)
    replace_hf_moe_blocks(off)
    assert [layer.aux_loss_weight for layer in layers(off)] == [0.0, 0.0]
    assert not any(hasattr(layer, "expert_bias") for layer in layers(off))
    given = model(output_router_logits=True, router_aux_loss_coef=0.02)
    replace_hf_moe_blocks(given, aux_loss_weight=0.5, bias_update_rate=0.01,
                          aux_loss_scope="global_batch")
    for layer in layers(given):
        assert (layer.aux_loss_weight, layer.bias_update_rate, layer.aux_loss_scope) == \
            (0.5, 0.01, "global_batch")
        assert torch.equal(layer.expert_bias, torch.zeros(4))
        assert layer.expert_bias.dtype == torch.float32


def test_output_router_logits_returns_the_layers_logits_and_their_aux_loss() -> None:
    reference = model().eval()  # output_router_logits=False in its config
    converted = copy.deepcopy(reference)
    replace_hf_moe_blocks(converted, aux_loss_weight=0.1)
    with torch.no_grad():
        expected = reference(input_ids=TOKENS, labels=TOKENS, output_router_logits=True)
        plain = converted(input_ids=TOKENS, labels=TOKENS)
        got = converted(input_ids=TOKENS, labels=TOKENS, output_router_logits=True)
    assert plain.router_logits is None and plain.aux_loss is None
    assert len(got.router_logits) == len(expected.router_logits) == 2
    # Layer 0's router sees the same input: the same logits, bit for bit. Layer 1's input
    # went through an MoE layer, whose sums are ordered otherwise: a few float32 ulps.
    assert torch.equal(got.router_logits[0], expected.router_logits[0])
    assert_close_to_scale(got.router_logits[1], expected.router_logits[1], ulps=64)
    # MoE's auxiliary loss (weighted), not transformers' Switch loss: added to the LM loss.
    total = sum(layer.aux_loss for layer in layers(converted))
    assert torch.equal(got.aux_loss, total) and got.aux_loss > 0
    assert torch.equal(got.loss, plain.loss + got.aux_loss)
    assert got.loss.shape == () and got["aux_loss"] is got.aux_loss
    with pytest.raises(TypeError, match="output_router_logits=True and return_dict=False: "
                                        ".*call it with return_dict=True"):
        converted(input_ids=TOKENS, output_router_logits=True, return_dict=False)
    # The config's flag asks as the argument does (without it, transformers raised an
    # IndexError on the empty tuple of routers it found).
    flagged = model(output_router_logits=True, router_aux_loss_coef=0.1)
    replace_hf_moe_blocks(flagged)
    out = flagged(input_ids=TOKENS, labels=TOKENS)
    assert len(out.router_logits) == 2 and out.aux_loss > 0
    assert out.aux_loss.requires_grad  # it trains the routers
    assert flagged(input_ids=TOKENS, output_router_logits=False).router_logits is None


class BalancedTrainer(HFTrainer):
    """A converted Qwen3-MoE whose config asks for router logits (aux weight 0.05) with the
    balancing bias on; records each step's output and the biases."""

    def configure_models(self) -> None:
        self.model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**{
            **qwen3_moe_config(layers=2).to_dict(), "output_router_logits": True,
            "router_aux_loss_coef": 0.05}))
        replace_hf_moe_blocks(self.model, bias_update_rate=0.01)
        self.records: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []

    def training_step(self, batch: Any, batch_idx: int) -> dict[str, Any]:
        (tokens,) = batch
        out = self.model(input_ids=tokens, labels=tokens)
        # The language-model loss as transformers' forward computes it from the logits.
        lm = self.model.loss_function(out.logits, tokens, self.model.config.vocab_size)
        self.records.append((out.loss.detach(), lm.detach(), out.aux_loss.detach()))
        self.backward(out.loss)
        self.step(self.model, self.optimizer)
        return {"loss": out.loss}


def test_a_converted_model_with_balancing_moves_its_bias_and_adds_its_aux_loss() -> None:
    trainer = BalancedTrainer(hf_config("qwen3_moe", training_parameters=TrainingParameters(
        n_epochs=1, train_batch_size=4, max_steps=3)))
    trainer.fit()
    assert len(trainer.records) == 3
    for loss, lm, aux in trainer.records:
        # MoE's loss with a uniform load is aux_loss_weight per layer; 2 layers.
        assert 0.05 < aux < 1.0
        assert torch.equal(loss, lm + aux)
    for layer in layers(trainer.model):
        assert layer.aux_loss_weight == 0.05
        # Moved by +-0.01 per step for each expert off the mean load, towards the mean.
        steps = layer.expert_bias / 0.01
        assert torch.equal(steps, steps.round()) and steps.abs().max() > 0
