"""The default split of transformers decoders, in one process: chaining the stages gives the
whole model's logits, for every decoder family the split claims (Llama, Qwen2, Qwen3, Mistral
with a sliding window shorter than the sequence), into 2 and 4 stages, with parameter names
unchanged. The distributed runs are in test_hf_pipeline.py."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from transformers import (LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM,
                          Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM)

from dream_trainer.parallel.hf_pipeline import is_hf_decoder, split_pipeline

VOCAB, SEQ = 64, 16
SHAPE = {"vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 4,
         "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 2 * SEQ}


def decoders() -> dict[str, nn.Module]:
    torch.manual_seed(0)
    return {
        "llama": LlamaForCausalLM(LlamaConfig(**SHAPE)),
        "qwen2": Qwen2ForCausalLM(Qwen2Config(**SHAPE)),
        "qwen3": Qwen3ForCausalLM(Qwen3Config(**SHAPE, head_dim=8)),
        # A window of 4 tokens over 16: a stage that built a plain causal mask would differ.
        "mistral": MistralForCausalLM(MistralConfig(**SHAPE, sliding_window=4)),
    }


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "mistral"])
@pytest.mark.parametrize("num_stages", [2, 4])
def test_chained_stages_give_the_whole_models_logits(family: str, num_stages: int) -> None:
    model = decoders()[family].eval()
    assert is_hf_decoder(model)
    tokens = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1))
    stages = split_pipeline(copy.deepcopy(model), list(range(num_stages)), num_stages)
    with torch.no_grad():
        expected = model(input_ids=tokens).logits
        carried = tokens
        for stage in stages:
            carried = stage(carried)
    # The same kernels on the same values, layer after layer: bit-identical.
    assert torch.equal(carried, expected)
    # Every parameter on exactly one stage, under the model's own name.
    names = [name for stage in stages for name, _ in stage.named_parameters()]
    assert sorted(names) == sorted(name for name, _ in model.named_parameters())


def test_the_sliding_window_matters_for_this_check() -> None:
    # Guards the Mistral case above: with the window, the logits differ from a full causal
    # mask's, so a stage that ignored the window would have failed it.
    windowed = decoders()["mistral"].eval()
    full = copy.deepcopy(windowed)
    full.config.sliding_window = None
    tokens = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        gap = (windowed(input_ids=tokens).logits - full(input_ids=tokens).logits).abs().max()
    assert gap > 1e-3
