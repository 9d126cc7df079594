"""Routed experts through torchao's low-precision grouped products
(``dream_trainer.parallel.float8_experts``).

torchao's float8 grouped kernel needs CUDA capability 9.0; its MXFP8 recipe has an emulated
kernel that runs on the CPU, which these tests use to check the wiring: the weight layout and
group padding torchao wants, gradients, and checkpoints that stay the high-precision model's.
"""

from __future__ import annotations

import copy
import logging
from pathlib import Path

import pytest
import torch

from dream_trainer.nn.moe import GroupedExperts
from dream_trainer.parallel.float8_experts import (convert_experts,
                                                   convert_experts_to_float8,
                                                   expert_float8_config)
from dream_trainer.parallel.state_dict import load_model_state_dict, model_state_dict

COUNTS = [10, 30, 0, 24]  # expert 2 gets no token


def emulated_mxfp8() -> object:
    from torchao.prototype.moe_training.config import MXFP8TrainingOpConfig, MXFP8TrainingRecipe

    return MXFP8TrainingOpConfig.from_recipe(MXFP8TrainingRecipe.MXFP8_EMULATED_RCEIL)


def experts() -> GroupedExperts:
    torch.manual_seed(0)
    return GroupedExperts(64, 128, 4).to(torch.bfloat16)


def relative(mine: torch.Tensor, theirs: torch.Tensor) -> float:
    return ((mine.float() - theirs.float()).norm() / theirs.float().norm()).item()


def test_quantized_experts_track_the_bf16_ones_and_train() -> None:
    """Within MXFP8's rounding of the bf16 experts (e4m3 keeps 3 mantissa bits, a relative
    step of 2**-4 per operand: measured 6.4% on the outputs, 8-9% on the gradients), yet not
    equal to them (the products did run quantized); an expert without tokens gets a zero
    gradient."""
    reference, converted = experts(), experts()
    assert convert_experts(converted, emulated_mxfp8()) == [""]
    tokens = torch.randn(sum(COUNTS), 64, dtype=torch.bfloat16, generator=torch.Generator()
                         .manual_seed(1))
    out, expected = converted(tokens, COUNTS), reference(tokens, COUNTS)
    out.float().pow(2).sum().backward()
    expected.float().pow(2).sum().backward()
    assert 1e-3 < relative(out, expected) < 0.12
    for name in ("w1", "w2", "w3"):
        mine, theirs = getattr(converted, name).grad, getattr(reference, name).grad
        assert 1e-3 < relative(mine, theirs) < 0.15, name
        assert torch.count_nonzero(mine[2]) == 0, name


def test_a_checkpoint_of_quantized_experts_is_the_high_precision_one(tmp_path: Path) -> None:
    """The state dict holds plain tensors; saved with torch DCP it loads bit for bit into a
    plain module and into a converted one."""
    import torch.distributed.checkpoint as dcp

    converted = experts()
    convert_experts(converted, emulated_mxfp8())
    state = model_state_dict(converted)
    assert all(type(value) is torch.Tensor for value in state.values())
    dcp.save(state, checkpoint_id=tmp_path)
    for target in (GroupedExperts(64, 128, 4).to(torch.bfloat16), experts()):
        loaded = model_state_dict(target)
        dcp.load(loaded, checkpoint_id=tmp_path)
        load_model_state_dict(target, loaded)
        for name in ("w1", "w2", "w3"):
            assert torch.equal(model_state_dict(target)[name], state[name]), name


def test_quantized_experts_need_grouped_products() -> None:
    converted = experts().float()
    convert_experts(converted, emulated_mxfp8())
    with pytest.raises(TypeError, match="must be bfloat16 or float16.*float32 tokens"):
        converted(torch.randn(sum(COUNTS), 64), COUNTS)


def test_float8_recipe_leaves_the_experts_alone_where_the_kernel_is_missing(
        caplog: pytest.LogCaptureFixture) -> None:
    """On the CPU (and CUDA below capability 9.0) torchao has no float8 grouped kernel, emulated
    or not: the experts keep their dtype, and the log says so."""
    model = torch.nn.ModuleDict({"experts": experts()})
    before = copy.deepcopy(model.state_dict())
    assert expert_float8_config(torch.device("cpu")) is None
    with caplog.at_level(logging.INFO, logger="dream_trainer.parallel.float8_experts"):
        assert convert_experts_to_float8(model, torch.device("cpu")) == []
    assert "1 routed expert modules stay in the parameters' dtype on cpu" in caplog.text
    assert type(model["experts"].w1.data) is torch.Tensor
    assert all(torch.equal(before[key], value) for key, value in model.state_dict().items())
