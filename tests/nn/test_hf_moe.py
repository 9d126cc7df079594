"""transformers MoE decoders (Mixtral, Qwen3-MoE with and without normalized top-k weights)
with their MoE blocks replaced by ``dream_trainer.nn.MoE``: the same logits from the same
weights, gradients through the new layers, and clear refusals of blocks MoE does not
reproduce."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from transformers import MixtralConfig, MixtralForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

from dream_trainer.nn import MoE, moe_from_hf, replace_hf_moe_blocks
from tests.helpers.tolerance import assert_close_to_scale

SHAPE = {"vocab_size": 64, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "max_position_embeddings": 32, "num_experts_per_tok": 2}


def model(family: str) -> nn.Module:
    torch.manual_seed(0)
    if family == "mixtral":
        return MixtralForCausalLM(MixtralConfig(**SHAPE, intermediate_size=48,
                                                num_local_experts=4))
    return Qwen3MoeForCausalLM(Qwen3MoeConfig(
        **SHAPE, intermediate_size=48, moe_intermediate_size=24, num_experts=4, head_dim=8,
        norm_topk_prob=family == "qwen3_moe_normalized"))


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe", "qwen3_moe_normalized"])
def test_replaced_blocks_give_the_same_logits(family: str) -> None:
    reference = model(family).eval()
    converted = copy.deepcopy(reference)
    names = replace_hf_moe_blocks(converted)
    assert names == ["model.layers.0.mlp", "model.layers.1.mlp"]
    assert all(isinstance(converted.get_submodule(name), MoE) for name in names)
    layer = converted.get_submodule(names[0])
    assert layer.normalize_scores == (family != "qwen3_moe")
    tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = reference(input_ids=tokens).logits
        actual = converted(input_ids=tokens).logits
    # The same products, the expert matrices read transposed: float32 rounding only, in 2
    # layers' sums; 64 ulps of the logits' scale (1e-5, the bound before, is ~80 at 1).
    assert_close_to_scale(actual, expected, ulps=64)
    assert (expected.abs().max() > 0.1)  # logits worth comparing
    converted.train()
    converted(input_ids=tokens).logits.sum().backward()
    assert layer.experts.w1.grad is not None and layer.router.weight.grad is not None


def test_the_mapping_of_one_expert() -> None:
    block = model("mixtral").model.layers[0].mlp
    layer = moe_from_hf(block)
    hidden = block.experts.down_proj.shape[-1]
    assert torch.equal(layer.experts.w1[3], block.experts.gate_up_proj[3, :hidden].T)
    assert torch.equal(layer.experts.w3[3], block.experts.gate_up_proj[3, hidden:].T)
    assert torch.equal(layer.experts.w2[3], block.experts.down_proj[3].T)
    assert torch.equal(layer.router.weight, block.gate.weight)


def test_blocks_moe_does_not_reproduce_are_refused_and_nothing_changes() -> None:
    jittery = model("mixtral")
    jittery.model.layers[1].mlp.jitter_noise = 0.1
    before = [type(layer.mlp) for layer in jittery.model.layers]
    with pytest.raises(ValueError, match="router_jitter_noise > 0"):
        replace_hf_moe_blocks(jittery)
    assert [type(layer.mlp) for layer in jittery.model.layers] == before  # not even layer 0
    shared = model("qwen3_moe").model.layers[0].mlp
    shared.shared_expert = nn.Linear(2, 2)
    with pytest.raises(ValueError, match="has a shared expert"):
        moe_from_hf(shared)
    with pytest.raises(ValueError, match="is not a transformers MoE block"):
        moe_from_hf(nn.Linear(2, 2))
