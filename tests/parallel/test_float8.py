"""float8 training through torchao, emulated on the CPU: which layers convert, parity across
layouts, checkpoints in both directions, SIGKILL/resume, and the optional import."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from pydantic import ValidationError
from torch import nn

from dream_trainer.configs import DeviceParameters
from dream_trainer.parallel.float8 import converts, filtered, float8_tensor_parallel_styles
from tests.helpers.launch import REPO, check, child_env, run_script
from tests.helpers.tolerance import assert_tensors_close_to_scale

pytest.importorskip("torchao")

from tests.scripts import float8_run
from tests.scripts.float8_run import CONVERTED, STEPS, float8_config, train

SCRIPT = REPO / "tests/scripts/float8_run.py"
# Measured over 4 SGD steps (lr 0.1) of the test GPT, emulated: float8 losses differ from
# float32 by at most 2.1e-3 (tensorwise), 1.5e-3 (rowwise), 1.4e-3 (rowwise_with_gw_hp), and
# from bfloat16 autocast by 2.4e-3, 1.8e-3, 1.8e-3 (bfloat16 from float32: 3.6e-4); the bound
# leaves room for other CPUs' rounding. Absolute, and far above float32's rounding: e4m3 keeps
# 3 mantissa bits, so float8's rounding sets this distance, not the CPU's kernels.
LOSS_TOLERANCE = 1e-2


def max_diff(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> float:
    assert actual.keys() == expected.keys()
    return max((actual[k] - expected[k]).abs().max().item() for k in expected)


@pytest.fixture(scope="module")
def one_process() -> dict[str, dict[str, Any]]:
    """One process, in-process: float32, bfloat16 autocast, and the tensorwise and
    rowwise_with_gw_hp recipes on the whole batch; and tensorwise accumulating two
    micro-batches, each the samples one of two data-parallel ranks reads."""
    recipes = {"fp32": None, "tensorwise": "tensorwise", "rowwise_gw_hp": "rowwise_with_gw_hp"}
    runs = {name: train(float8_config(DeviceParameters.SINGLE_DEVICE(float8_recipe=recipe), 1))
            for name, recipe in recipes.items()}
    runs["bf16"] = train(float8_config(DeviceParameters.SINGLE_DEVICE(param_dtype="bf16"), 1))
    runs["tensorwise_per_rank"] = train(float8_config(
        DeviceParameters.SINGLE_DEVICE(float8_recipe="tensorwise"), 1, micro_batches=2,
        ranks_as_micro_batches=True))
    for name, recipe in recipes.items():
        if recipe is not None:  # as a two-stage pipeline splits each batch
            runs[f"{name}_micro_batches"] = train(float8_config(
                DeviceParameters.SINGLE_DEVICE(float8_recipe=recipe), 1, micro_batches=2))
    return runs


@pytest.fixture(scope="module")
def fsdp(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    root = tmp_path_factory.mktemp("float8_fsdp")
    check(run_script(SCRIPT, 2, root / "out.pt", root / "run", "fsdp", timeout=400))
    return torch.load(root / "out.pt", weights_only=False)  # type: ignore[no-any-return]


# -- which layers convert ------------------------------------------------------------------------
def test_filter_matches_whole_name_components() -> None:
    assert filtered("head", ["head"]) and filtered("model.head", ["head"])
    assert filtered("layers.0.mlp.w1", ["layers.0"])
    assert not filtered("heads.q", ["head"]) and not filtered("layers.10.q", ["layers.1"])
    assert converts(nn.Linear(32, 64), "layers.0.w1", ["head"])
    assert not converts(nn.Linear(32, 24), "layers.0.down", ["head"])  # 24 % 16 != 0
    assert not converts(nn.Linear(32, 32), "head", ["head"])
    assert not converts(nn.LayerNorm(32), "norm", [])
    # By default an MoE router stays in high precision even when its shape would convert
    # (16 experts): dream_trainer's MoE names it router, transformers' MoE blocks gate. A
    # dense MLP's gate_proj is another name and converts.
    default = DeviceParameters(float8_recipe="tensorwise").float8_filter
    assert not converts(nn.Linear(32, 16), "layers.0.moe.router", default)
    assert not converts(nn.Linear(32, 16), "model.layers.0.mlp.gate", default)
    assert converts(nn.Linear(32, 64), "model.layers.0.mlp.gate_proj", default)
    assert not converts(nn.Linear(32, 32000), "lm_head", default)
    # A model without float8 layers gets torch's own tensor-parallel styles.
    assert [style.__name__ for style in float8_tensor_parallel_styles(nn.Linear(16, 16))] \
        == ["ColwiseParallel", "RowwiseParallel", "PrepareModuleInput"]


def test_one_process_converts_exactly_the_expected_layers(
        one_process: dict[str, dict[str, Any]]) -> None:
    types = one_process["tensorwise"]["layer_types"]
    assert sorted(name for name, kind in types.items() if kind == "Float8Linear") == CONVERTED
    assert types["head"] == "Linear" and types["layers.0.down"] == "Linear"
    assert set(one_process["fp32"]["layer_types"].values()) == {"Linear"}


def test_state_dict_keys_do_not_change(one_process: dict[str, dict[str, Any]]) -> None:
    assert one_process["tensorwise"]["keys"] == one_process["fp32"]["keys"]
    for weights in one_process["tensorwise"]["final"].values():
        assert type(weights) is torch.Tensor and weights.dtype == torch.float32


def test_float8_losses_stay_close_to_float32_and_bfloat16(
        one_process: dict[str, dict[str, Any]]) -> None:
    for reference in ("fp32", "bf16"):
        expected = torch.tensor(one_process[reference]["losses"])
        assert len(expected) == STEPS
        for recipe in ("tensorwise", "rowwise_gw_hp"):
            losses = torch.tensor(one_process[recipe]["losses"])
            assert len(losses) == STEPS
            assert (losses - expected).abs().max() < LOSS_TOLERANCE, (recipe, reference)
            assert not torch.equal(losses, expected), f"{recipe} did not change the numerics"


def test_activation_checkpointing_recomputes_the_float8_layers_exactly(
        one_process: dict[str, dict[str, Any]]) -> None:
    # Conversion precedes the checkpoint wrappers, which then recompute Float8Linear layers
    # with the same dynamic scales: bit-exact against the stored activations.
    run = train(float8_config(DeviceParameters.SINGLE_DEVICE(
        float8_recipe="tensorwise", checkpoint_activations=True), 1))
    wrapped = {name.replace("._checkpoint_wrapped_module", ""): kind
               for name, kind in run["layer_types"].items()}
    assert wrapped == one_process["tensorwise"]["layer_types"]
    assert wrapped != run["layer_types"], "the blocks were not checkpointed"
    assert run["keys"] == one_process["tensorwise"]["keys"]
    assert max_diff(run["final"], one_process["tensorwise"]["final"]) == 0.0


def test_compile_trains_the_float8_layers_as_eager_does(
        one_process: dict[str, dict[str, Any]]) -> None:
    # Conversion precedes compilation, so each compiled block holds the Float8Linear layers.
    # Inductor fuses the casts and scales into other kernels: equal to eager up to float
    # rounding (measured 6e-8). The cold compile takes most of this test's time.
    run = train(float8_config(DeviceParameters.SINGLE_DEVICE(
        float8_recipe="tensorwise", compile_model=True), 1))

    def uncompiled(named: dict[str, Any]) -> dict[str, Any]:
        return {name.replace("._orig_mod", ""): value for name, value in named.items()}

    compiled = uncompiled(run["layer_types"])
    assert compiled == one_process["tensorwise"]["layer_types"]
    assert compiled != run["layer_types"], "the blocks were not compiled"
    final = uncompiled(run["final"])
    assert_tensors_close_to_scale(final, one_process["tensorwise"]["final"], ulps=16)
    assert max_diff(final, one_process["fp32"]["final"]) > 1e-6


def test_emulation_is_logged_once(caplog: pytest.LogCaptureFixture) -> None:
    from dream_trainer.parallel.float8 import _log_emulation

    _log_emulation.cache_clear()
    with caplog.at_level("WARNING", logger="dream_trainer.parallel.float8"):
        train(float8_config(DeviceParameters.SINGLE_DEVICE(float8_recipe="rowwise"), 1,
                            max_steps=1))
        train(float8_config(DeviceParameters.SINGLE_DEVICE(float8_recipe="rowwise"), 1,
                            max_steps=1))
    assert sum("emulated on cpu" in r.getMessage() for r in caplog.records) == 1


def test_export_writes_ordinary_weights(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    from tests.scripts.float8_run import Float8Trainer

    trainer = Float8Trainer(float8_config(
        DeviceParameters.SINGLE_DEVICE(float8_recipe="tensorwise"), 1, max_steps=1))
    trainer.fit()
    written = trainer.export_weights(tmp_path, format="safetensors")
    weights = load_file(written["model"])
    assert weights.keys() == trainer.final.keys()
    for key, value in weights.items():
        assert value.dtype == torch.float32 and torch.equal(value, trainer.final[key]), key


# -- distributed (one 2-rank and one 4-rank launch) ---------------------------------------------
@pytest.mark.distributed
def test_fsdp_float8_all_gather_equals_ddp_and_one_process(
        fsdp: dict[str, dict[str, Any]], one_process: dict[str, dict[str, Any]]) -> None:
    run = fsdp["float8"]
    assert sorted(n for n, kind in run["layer_types"].items() if kind == "Float8Linear") \
        == CONVERTED
    # The converted weights carry torchao's float8 all-gather tensor inside FSDP2's DTensor.
    assert {name.rsplit(".", 1)[0] for name, kind in run["weight_types"].items()
            if kind == "WeightWithDynamicFloat8CastTensor"} == set(CONVERTED)
    # Same per-rank activation scales, weights gathered in float32 and cast on each rank:
    # the float8 all-gather changes nothing.
    assert max_diff(run["final"], fsdp["ddp"]["final"]) == 0.0
    # EMA averages the high-precision weights, float8 all-gather or not.
    assert max_diff(run["ema"], fsdp["ddp"]["ema"]) == 0.0
    # Histograms gather each float8 weight's shards as plain float32 tensors: at step 0
    # exactly the weights the run started from.
    weights = {key.removeprefix("weights/model/").removesuffix("@0"): values
               for key, values in run["histograms"].items()
               if key.startswith("weights/") and key.endswith("@0")}
    assert max_diff(weights, run["loaded"]) == 0.0
    assert {(type(v), v.dtype) for v in run["histograms"].values()} == {(torch.Tensor,
                                                                         torch.float32)}
    assert all(value.dtype == torch.float32 for value in run["ema"].values())
    assert max_diff(run["ema"], {f"model.{k}": v for k, v in run["final"].items()}) > 0
    # Tensorwise activation and gradient scales are per rank (the amax of its own
    # micro-batch); weight scales are global (FSDP2 all-reduces each weight's amax). One
    # process accumulating the ranks' micro-batches computes the same scales: equal up to
    # the order of the gradient sums (measured 1.2e-7, an ulp or two of the scale).
    assert_tensors_close_to_scale(run["final"], one_process["tensorwise_per_rank"]["final"],
                                  ulps=16)
    # One process on the whole batch scales by the whole batch's amax: float8 noise apart
    # (measured 4.5e-4 after 4 steps), so the per-rank reference above is the right one.
    whole_batch = max_diff(run["final"], one_process["tensorwise"]["final"])
    assert 1e-6 < whole_batch < 5e-3
    # rowwise_with_gw_hp scales per row and keeps weight gradients in high precision: the
    # batch split does not matter (measured 6e-8).
    assert_tensors_close_to_scale(fsdp["rowwise_gw_hp"]["final"],
                                  one_process["rowwise_gw_hp"]["final"], ulps=16)


@pytest.mark.distributed
def test_pipeline_stages_convert_and_equal_one_process_on_the_same_micro_batches(
        fsdp: dict[str, dict[str, Any]], one_process: dict[str, dict[str, Any]]) -> None:
    for name, recipe in (("tensorwise", "tensorwise"), ("rowwise_gw_hp", "rowwise_with_gw_hp")):
        run, reference = fsdp[f"pp_{recipe}"], one_process[f"{name}_micro_batches"]
        # Each stage converts its own layers (gathered from both stages here).
        assert sorted(n for n, kind in run["layer_types"].items() if kind == "Float8Linear") \
            == CONVERTED
        assert run["keys"] == one_process["fp32"]["keys"]
        # A stage runs each micro-batch through its layers as one process accumulating the
        # same micro-batches does, float8 scales included: measured equal bit for bit.
        assert_tensors_close_to_scale(run["final"], reference["final"], ulps=16)
        assert max_diff(reference["final"], one_process["fp32"]["final"]) > 1e-6


@pytest.mark.distributed
def test_resume_float8_to_plain_and_back(fsdp: dict[str, dict[str, Any]]) -> None:
    float8, plain, back = fsdp["float8"], fsdp["plain"], fsdp["back"]
    assert float8["keys"] == plain["keys"] == back["keys"]
    assert set(plain["weight_types"].values()) == {"Tensor"}
    assert max_diff(plain["loaded"], float8["final"]) == 0.0
    assert max_diff(back["loaded"], plain["final"]) == 0.0
    assert (float8["global_step"], plain["global_step"], back["global_step"]) \
        == (STEPS, STEPS + 2, STEPS + 4)


@pytest.mark.distributed
def test_tensor_parallel_x_fsdp_converts_and_trains(tmp_path: Path,
                                                    fsdp: dict[str, dict[str, Any]]) -> None:
    check(run_script(SCRIPT, 4, tmp_path / "out.pt", tmp_path / "run", "tp_fsdp",
                     timeout=400))
    run = torch.load(tmp_path / "out.pt", weights_only=False)["tp_fsdp"]
    assert run["tp_styles"] == ("Float8ColwiseParallel", "Float8RowwiseParallel")
    assert sorted(n for n, kind in run["layer_types"].items() if kind == "Float8Linear") \
        == CONVERTED
    assert {name.rsplit(".", 1)[0] for name, kind in run["weight_types"].items()
            if kind == "WeightWithDynamicFloat8CastTensor"} == set(CONVERTED)
    assert run["keys"] == fsdp["float8"]["keys"]
    # FSDP2 reduces each weight's amax over its own ranks, so under TP every TP shard of a
    # weight has its own scale: close to the FSDP2-only run, not equal (measured: losses
    # 8.2e-4, weights 4.1e-4 apart).
    losses = torch.tensor(run["losses"]) - torch.tensor(fsdp["float8"]["losses"])
    assert losses.abs().max() < LOSS_TOLERANCE
    assert max_diff(run["final"], fsdp["float8"]["final"]) < 5e-3


@pytest.mark.distributed
def test_sigkill_and_resume_is_bit_exact(tmp_path: Path) -> None:
    # The uninterrupted run here (a process of its own would import torchao once more).
    float8_run.main(str(tmp_path / "whole.pt"), str(tmp_path / "whole"), "kill")
    kills = ["step:5"]  # after step 5, resumed from the step 4 checkpoint
    for attempt in range(len(kills) + 1):
        result = run_script(SCRIPT, 1, tmp_path / "killed.pt", tmp_path / "killed", "kill",
                            *kills)
        assert (result.returncode == 0) == (attempt == len(kills)), result.stderr[-3000:]
    whole = torch.load(tmp_path / "whole.pt")
    killed = torch.load(tmp_path / "killed.pt")
    assert whole.keys() == killed.keys()
    for key, value in whole.items():
        assert torch.equal(killed[key], value), key


# -- configuration and the optional import ------------------------------------------------------
def test_config_validation_names_the_field_and_fix() -> None:
    with pytest.raises(ValidationError, match="float8_recipe"):
        DeviceParameters(float8_recipe="blockwise")
    with pytest.raises(ValidationError, match="float8_filter is set but float8_recipe is None"):
        DeviceParameters(float8_filter=("head",))
    # A configuration dumped with the earlier default (before MoE routers joined it) loads.
    assert DeviceParameters.model_validate(
        {"float8_filter": ["output", "head", "lm_head"]}).float8_recipe is None
    with pytest.raises(ValidationError, match="not a module name"):
        DeviceParameters(float8_recipe="rowwise", float8_filter=("layers..q",))
    params = DeviceParameters(float8_recipe="rowwise", float8_filter=("head", "layers.0"))
    assert DeviceParameters.model_validate(params.model_dump()) == params
    assert DeviceParameters.model_validate(DeviceParameters().model_dump()).float8_recipe is None


def test_missing_torchao_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [name for name in sys.modules if name.startswith("torchao")]:
        monkeypatch.setitem(sys.modules, name, None)
    monkeypatch.setitem(sys.modules, "torchao", None)
    with pytest.raises(ImportError, match=r"pip install 'dream-trainer\[float8\]'"):
        train(float8_config(DeviceParameters.SINGLE_DEVICE(float8_recipe="tensorwise"), 1))


def test_import_does_not_load_torchao() -> None:
    code = ("import sys, dream_trainer, dream_trainer.mixins, dream_trainer.parallel.float8; "
            "assert 'torchao' not in sys.modules, 'torchao imported'")
    subprocess.run([sys.executable, "-c", code], check=True, env=child_env(), cwd=REPO)


# -- planning ------------------------------------------------------------------------------------
@pytest.mark.usefixtures("restore_imports")
def test_plan_counts_float8_all_gathers_at_one_byte_per_parameter(
        capsys: pytest.CaptureFixture[str]) -> None:
    import json

    from dream_trainer.cli import main
    from tests.scripts.plan_trainer import DIM, LAYERS

    target = f"{REPO / 'tests/scripts/plan_trainer.py'}:make_trainer"
    traffic = {}
    for recipe in ("null", '"tensorwise"'):
        assert main(["plan", target, "--world-size", "8", "--json", "--", "--device_parameters",
                     f'{{"dp_replicate": 1, "dp_shard": "auto", "float8_recipe": {recipe}}}']) == 0
        plan = json.loads(capsys.readouterr().out)
        traffic[recipe] = plan["ranks"]["0"]["collectives"]["dp_shard"]
    # q, k, v, o (DIM x DIM) and up, down (DIM x 4 DIM) of each block convert; the head is
    # filtered. Each is gathered twice a step (forward, and again for backward): 1 byte per
    # element instead of 4, plus one float32 all-reduce of its amax per gather.
    float8_elements = LAYERS * (4 * DIM * DIM + 2 * 4 * DIM * DIM)
    amax_reduces = traffic['"tensorwise"']["count"] - traffic["null"]["count"]
    assert amax_reduces == 2 * LAYERS * 6
    assert traffic["null"]["bytes"] - traffic['"tensorwise"']["bytes"] \
        == 2 * 3 * float8_elements - 4 * amax_reduces
