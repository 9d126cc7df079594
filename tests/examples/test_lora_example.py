"""examples/lora.py runs end to end: a peft LoRA fine-tune of a transformers Llama on 2 FSDP2
ranks from a base directory, its adapter exported for ``PeftModel.from_pretrained``."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from tests.examples.test_examples import val_losses
from tests.helpers.launch import REPO, check, torchrun

LORA = REPO / "examples/lora.py"
STEPS = 12
# A two-layer Llama of width 32 on 32-byte windows, r=8 on the seven projections.
TINY_LLAMA = ["--llama.hidden_size", "32", "--llama.intermediate_size", "64",
              "--llama.num_hidden_layers", "2", "--llama.context", "32"]
SHORT_RUN = ["--training_parameters.n_epochs", "1",
             "--training_parameters.train_steps_per_epoch", str(STEPS),
             "--training_parameters.val_steps_per_epoch", "2"]
# Parameters of that Llama: embedding and head 256x32 each, the final norm 32, and per layer
# q and o 32x32, k and v 16x32 (2 of 4 heads of width 8), gate and up 64x32, down 32x64 and
# two norms of 32.
BASE_PARAMS = 2 * 256 * 32 + 32 + 2 * (2 * 32 * 32 + 2 * 16 * 32 + 3 * 64 * 32 + 2 * 32)
# Each adapted projection adds A (8 x in) and B (out x 8): per layer 8 x the sum of the seven
# projections' in + out (q 64, k 48, v 48, o 64, gate 96, up 96, down 96).
ADAPTER_PARAMS = 2 * 8 * (64 + 48 + 48 + 64 + 96 + 96 + 96)


def printed(pattern: str, output: str) -> re.Match[str]:
    match = re.search(pattern, output, re.M)
    assert match, output
    return match


@pytest.mark.distributed
def test_lora_example_trains_only_the_adapters_and_exports_them_for_peft(
        tmp_path: Path) -> None:
    out = check(torchrun(LORA, [*TINY_LLAMA, *SHORT_RUN], nproc=2, cwd=tmp_path,
                         timeout=300)).stdout
    outputs = tmp_path / "outputs/examples/lora"
    assert printed(r"^started from (.+)$", out).group(1) == str(outputs / "pretrained")
    trainable, total = map(int, printed(r"^trainable parameters: (\d+) of (\d+)$", out).groups())
    assert (trainable, total) == (ADAPTER_PARAMS, BASE_PARAMS + ADAPTER_PARAMS), out

    # The stand-in base is random: about ln(256) = 5.55 per byte before any step, since the
    # adapters start as the base (B at zero). The adapters alone bring it down (by 0.26 in
    # these 12 steps); without them the validation loss would repeat to the last digit (the
    # same frozen weights on the same batches).
    (_, start), (step, end) = val_losses(out)
    assert step == STEPS and abs(start - 5.55) < 0.3, out
    assert end < start - 0.15, out

    # The adapter loaded by peft onto the stand-in base it started from computes the trained
    # model's logits up to float rounding (logits of scale ~1; 1e-5 is some tens of float32
    # ulps): the base's weights did not change in training, only the exported adapters.
    assert float(printed(r"logits differ by ([\d.e+-]+)", out).group(1)) <= 1e-5, out
    adapter = outputs / "adapter"
    assert {p.name for p in adapter.iterdir()} == {"adapter_config.json",
                                                   "adapter_model.safetensors"}
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    tensors = load_file(adapter / "adapter_model.safetensors")
    assert len(tensors) == 2 * 7 * 2  # an A and a B per projection and layer, nothing else
    assert all(".lora_A." in key or ".lora_B." in key for key in tensors), sorted(tensors)
    assert sum(t.numel() for t in tensors.values()) == ADAPTER_PARAMS
    model = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(outputs / "pretrained"), adapter).eval()
    lora_b = {name: p for name, p in model.named_parameters() if ".lora_B." in name}
    assert len(lora_b) == 14 and all(bool(p.any()) for p in lora_b.values())  # B left zero
    tokens = torch.arange(64).view(2, 32) * 7 % 256
    with torch.no_grad():
        tuned = model(input_ids=tokens).logits
        with model.disable_adapter():
            base = model(input_ids=tokens).logits
    # Training moved the logits by far more than rounding (they start at a scale of ~0.1).
    assert (tuned - base).abs().max() > 0.1
