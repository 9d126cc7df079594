"""torchtitan's MoE modules as ``MoE`` layers: the same outputs from the same weights, clear
refusals of what ``MoE`` does not reproduce, the key map between torchtitan's files and the
converted layers, and a model of such layers trained under expert_parallel=2 (2 gloo ranks)
to one process's weights, loaded from and exported to files in torchtitan's layout.

The torchtitan-style module is ``tests/helpers/titan_moe.py`` (torchtitan is no dependency).
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from dream_trainer.nn import MoE, moe_from_torchtitan, replace_torchtitan_moe_blocks
from dream_trainer.weights import TransformedKey, torchtitan_moe_key
from tests.helpers.launch import REPO, check, torchrun
from tests.helpers.tolerance import assert_close_to_scale
from tests.helpers.titan_moe import EXPERTS, TitanModel, TitanMoE
from tests.scripts.titan_moe_run import pretrained_files, run, titan_model

SCRIPT = REPO / "tests/scripts/titan_moe_run.py"
SETTINGS = {
    "softmax": {},
    # DeepSeek-V3's router: sigmoid scores, normalized then scaled, a shared expert, the bias.
    "deepseek_v3": {"score_func": "sigmoid", "route_norm": True, "route_scale": 2.5,
                    "num_shared_experts": 2, "load_balance_coeff": 1e-3},
}


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_converted_layers_compute_what_the_torchtitan_modules_compute(setting: str) -> None:
    torch.manual_seed(0)
    reference = TitanModel(**SETTINGS[setting])  # type: ignore[arg-type]
    for layer in reference.layers:
        if layer.moe.expert_bias is not None:  # a bias that changes choices
            layer.moe.expert_bias.normal_(std=0.1)
    converted = copy.deepcopy(reference)
    assert replace_torchtitan_moe_blocks(converted) == ["layers.0.moe", "layers.1.moe"]
    layer = converted.layers[0].moe
    assert isinstance(layer, MoE)
    source = reference.layers[0].moe
    assert torch.equal(layer.router.weight, source.router.gate.weight)
    assert torch.equal(layer.experts.w2[3], source.experts.w2[3].T)
    if setting == "deepseek_v3":
        assert (layer.score_func, layer.normalize_scores, layer.route_scale) == \
            ("sigmoid", True, 2.5)
        assert layer.bias_update_rate == 1e-3
        assert torch.equal(layer.expert_bias, source.expert_bias)
        assert torch.equal(layer.shared_experts.w3.weight, source.shared_experts.w3.weight)
    x = torch.randn(64, 4, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected, actual = reference(x), converted(x)
    # The same products; the top-k weights are summed per token in another order (torchtitan
    # a float32 bmm, MoE an index_add), so a few float32 ulps of the outputs' scale.
    assert_close_to_scale(actual, expected, ulps=16)
    assert expected.abs().max() > 0.1


def test_what_moe_does_not_reproduce_is_refused_and_nothing_changes() -> None:
    model = TitanModel()
    model.layers[1].moe.score_before_experts = True
    before = [type(layer.moe) for layer in model.layers]
    with pytest.raises(ValueError, match=r"score_before_experts=True\); MoE scales their "
                                         r"outputs.*build it with score_before_experts=False"):
        replace_torchtitan_moe_blocks(model)
    assert [type(layer.moe) for layer in model.layers] == before  # not even layer 0
    grouped = TitanMoE()
    grouped.router.num_expert_groups = 2
    with pytest.raises(ValueError, match="num_expert_groups"):
        moe_from_torchtitan(grouped)
    biased = TitanMoE()
    biased.router.gate.bias = torch.nn.Parameter(torch.zeros(EXPERTS))
    with pytest.raises(ValueError, match="gate_bias=True"):
        moe_from_torchtitan(biased)
    shared = TitanMoE(num_shared_experts=1)
    shared.shared_experts.w1 = torch.nn.Linear(8, 7, bias=False)
    with pytest.raises(ValueError, match="shared experts are 7 wide, not a multiple of the "
                                         "routed experts' 12"):
        moe_from_torchtitan(shared)
    with pytest.raises(ValueError, match="is not torchtitan's MoE"):
        moe_from_torchtitan(MoE(8, 12, 4, 2))


def test_the_key_map_renames_the_router_and_transposes_the_experts() -> None:
    assert torchtitan_moe_key("layers.3.moe.router.gate.weight") == "layers.3.moe.router.weight"
    assert torchtitan_moe_key("layers.3.moe.router.weight", to="file") \
        == "layers.3.moe.router.gate.weight"
    for to in ("model", "file"):
        assert torchtitan_moe_key("layers.3.moe.experts.w2", to=to) \
            == TransformedKey("layers.3.moe.experts.w2", transpose=(1, 2))  # type: ignore
        assert torchtitan_moe_key("layers.3.moe.shared_experts.w1.weight", to=to) \
            == "layers.3.moe.shared_experts.w1.weight"  # type: ignore[arg-type]
    assert torchtitan_moe_key("layers.3.moe.tokens_per_expert") is None
    with pytest.raises(ValueError, match="to='files' is not 'model' or 'file'"):
        torchtitan_moe_key("x", to="files")  # type: ignore[arg-type]


def file_tensors(path: Path) -> dict[str, torch.Tensor]:
    with safe_open(str(path / "model.safetensors"), "pt") as file:
        return {key: file.get_tensor(key) for key in file.keys()}


@pytest.mark.distributed
def test_expert_parallel_trains_as_one_process_from_and_to_torchtitan_files(
        tmp_path: Path) -> None:
    torch.manual_seed(0)
    source = titan_model()
    pretrained = tmp_path / "pretrained"
    pretrained.mkdir()
    files = pretrained_files(source)
    save_file(files, str(pretrained / "model.safetensors"), metadata={"format": "pt"})
    check(torchrun(SCRIPT, [str(tmp_path / "ep2.pt"), str(tmp_path), str(pretrained), "ep2"],
                   timeout=300))
    got: dict[str, Any] = torch.load(tmp_path / "ep2.pt")
    one = run("one", pretrained, tmp_path)
    # The load: the converted model holds the torchtitan weights, transposed, bit for bit.
    expected = {key: value.transpose(1, 2) if key.endswith((".w1", ".w2", ".w3"))
                and ".experts." in key else value for key, value in source.state_dict().items()}
    expected = {key.replace("router.gate.weight", "router.weight"): value
                for key, value in expected.items()}
    for initial in (got["initial"], one.initial):
        assert initial.keys() == expected.keys()
        for key, value in expected.items():
            assert torch.equal(initial[key], value), key
    # Each rank read only its 2 experts of each stacked tensor: rows 2r and 2r+1.
    for rank, read in enumerate(got["read"]):
        experts = [(offsets, lengths) for key, offsets, lengths in read if ".experts.w" in key]
        assert len(experts) == 6  # 2 layers x w1, w2, w3
        assert all(offsets[0] == 2 * rank and lengths[0] == 2 for offsets, lengths in experts)
    # The steps: 3 SGD steps of 2 ranks x 8 samples against one process's 16. Other sums
    # (the batch mean over two ranks, the experts' gradients added across them): a few
    # float32 ulps of each tensor's scale per step.
    moved = 0.0
    for key, value in one.final.items():
        assert_close_to_scale(got["final"][key], value, ulps=16, msg=key)
        moved = max(moved, float((value - one.initial[key]).abs().max()))
    assert moved > 1e-3
    for key in ("layers.0.moe.expert_bias", "layers.1.moe.expert_bias"):
        assert torch.equal(got["final"][key], one.final[key])
        assert got["final"][key].abs().sum() > 0  # the balancing moved it
    # The export: torchtitan's layout again, each tensor the trained one.
    for layout, final in (("ep2", got["final"]), ("one", one.final)):
        exported = file_tensors(tmp_path / f"export_{layout}")
        assert exported.keys() == files.keys()
        assert torch.equal(exported["layers.1.moe.experts.w1"],
                           final["layers.1.moe.experts.w1"].transpose(1, 2))
        assert torch.equal(exported["layers.0.moe.router.gate.weight"],
                           final["layers.0.moe.router.weight"])
        assert torch.equal(exported["embed.weight"], final["embed.weight"].reshape(-1))
        reloaded = titan_model()
        reloaded.load_state_dict({**exported, "embed.weight": exported["embed.weight"]
                                  .reshape(final["embed.weight"].shape)})
        assert torch.equal(reloaded.layers[0].moe.experts.w3,
                           final["layers.0.moe.experts.w3"].transpose(1, 2))
