"""Hugging Face MoE checkpoints in and out: a tiny Qwen3-MoE and a tiny Mixtral saved by
``save_pretrained`` (one tensor per expert) load into models whose MoE blocks are
``dream_trainer.nn.MoE`` (stacked experts) with ``init_weights_from``, on one process and
under expert_parallel=2 (each rank reading only its experts' tensors), and after a few steps
``export_weights(format="hf")`` and ``dream-trainer export --format hf`` write what
``from_pretrained`` loads into the trained model's logits."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM

from dream_trainer.checkpoint import CheckpointError, export_checkpoint
from dream_trainer.checkpoint.pretrained import PretrainedWeights
from dream_trainer.cli import main as cli
from dream_trainer.nn import replace_hf_moe_blocks
from dream_trainer.nn.hf_moe import HF_FILE_LAYOUT
from tests.helpers.hf import fixed_batch, logits
from tests.helpers.launch import REPO, check, torchrun
from tests.helpers.tolerance import assert_close_to_scale
from tests.scripts.hf_moe_run import build, run, save_pretrained

FAMILIES = ("qwen3_moe", "mixtral")
# The same products in another order differ by ~6e-8 here: 64 ulps of the logits' scale
# (the issue's 1e-5 is ~80 at logits of scale 1), for a few layers' sums.
LOGIT_ULPS = 64
SCRIPT = REPO / "tests" / "scripts" / "hf_moe_run.py"


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Any]]:
    """Each family saved by ``save_pretrained``, and the model that saved it."""
    saved = {}
    for family in FAMILIES:
        path = tmp_path_factory.mktemp(family)
        saved[family] = (path, save_pretrained(family, path))  # type: ignore[arg-type]
    return saved


def file_keys(directory: Path) -> set[str]:
    with safe_open(str(directory / "model.safetensors"), "pt") as file:
        return set(file.keys())


def expert_slices(model: Any, family: str) -> dict[str, torch.Tensor]:
    """Layer 0's router and expert 3's gate projection of a transformers model (stacked)."""
    block = model.model.layers[0].mlp
    hidden = block.experts.down_proj.shape[-1]
    return {"router": block.gate.weight, "gate_3": block.experts.gate_up_proj[3, :hidden]}


@pytest.mark.parametrize("family", FAMILIES)
def test_one_process_loads_fine_tunes_and_exports_what_transformers_loads(
        family: str, pretrained: dict[str, tuple[Path, Any]], tmp_path: Path) -> None:
    path, reference = pretrained[family]
    trainer = run(family, path, tmp_path, "one")  # type: ignore[arg-type]
    assert_close_to_scale(trainer.initial, logits(reference, fixed_batch()), ulps=LOGIT_ULPS)
    assert (trainer.final - trainer.initial).abs().max() > 0.1  # the steps moved the weights
    layer = trainer.model.model.layers[0].mlp
    assert getattr(layer, HF_FILE_LAYOUT) is not None
    checkpoint = trainer.checkpoint_dir / f"step_{trainer.global_step}"
    assert cli(["export", str(checkpoint), str(tmp_path / "cli"), "--format", "hf",
                "--config-from", str(path)]) == 0
    for exported in (tmp_path / f"live_{family}_one", tmp_path / "cli"):
        # The layout save_pretrained writes, one tensor per expert, and nothing else.
        assert file_keys(exported) == file_keys(path)
        loaded = AutoModelForCausalLM.from_pretrained(exported)
        assert_close_to_scale(logits(loaded, fixed_batch()), trainer.final, ulps=LOGIT_ULPS)
        # The trained router and experts, not the pretrained ones, came back.
        slices = expert_slices(loaded, family)
        assert torch.equal(slices["router"], layer.router.weight.detach())
        assert torch.equal(slices["gate_3"], layer.experts.w1[3].detach().T)
        assert not torch.equal(slices["gate_3"], expert_slices(reference, family)["gate_3"])


def test_two_ranks_read_only_their_experts_and_export(
        pretrained: dict[str, tuple[Path, Any]], tmp_path: Path) -> None:
    """expert_parallel=2 (with FSDP2 over the same 2 ranks) and FSDP2 alone, one launch;
    and FSDP2 on the model as transformers builds it (``fsdp_asis``: its stacked
    ``experts.gate_up_proj`` read from the same per-expert files, each rank its experts)."""
    sources = [f"{family}={pretrained[family][0]}" for family in FAMILIES]
    check(torchrun(SCRIPT, [str(tmp_path / "out.pt"), str(tmp_path), "ep2,fsdp,fsdp_asis",
                            *sources], nproc=2, timeout=400))
    results = torch.load(tmp_path / "out.pt", weights_only=False)
    # One process reads the 2 ranks' batches of 4 as one batch of 8.
    ones = {(family, kind): run(family, pretrained[family][0], tmp_path / kind,  # type: ignore
                                kind, batch=8)
            for family in FAMILIES for kind in ("one", "one_asis")}
    assert len(results) == 6
    for (layout, family), result in results.items():
        one = {family: ones[family, "one_asis" if layout.endswith("_asis") else "one"]}
        reference = pretrained[family][1]
        assert_close_to_scale(result["initial"], logits(reference, fixed_batch()),
                              ulps=LOGIT_ULPS)
        # Rank r holds experts 2r and 2r+1 of every layer (split by ep, or by FSDP2 on the
        # stacked dimension) and reads only their tensors.
        for rank, read in enumerate(result["read"]):
            experts = {key.split(".experts.")[1].split(".")[0] for key in read
                       if ".experts." in key}
            assert experts == {str(2 * rank), str(2 * rank + 1)}, (rank, experts)
        # The same steps as one process, up to the order of float sums.
        assert_close_to_scale(result["final"], one[family].final, ulps=LOGIT_ULPS)
        cli_dir = tmp_path / f"cli_{family}_{layout}"
        assert cli(["export", result["checkpoint"], str(cli_dir), "--format", "hf",
                    "--config-from", str(pretrained[family][0])]) == 0
        for exported in (Path(result["exported"]["model"]), cli_dir):
            assert file_keys(exported) == file_keys(pretrained[family][0])
            loaded = AutoModelForCausalLM.from_pretrained(exported)
            assert_close_to_scale(logits(loaded, fixed_batch()), result["final"],
                                  ulps=LOGIT_ULPS)


def converted(family: str) -> Any:
    torch.manual_seed(1)
    model = build(family)  # type: ignore[arg-type]
    replace_hf_moe_blocks(model)
    return model


def test_a_missing_expert_tensor_is_named(pretrained: dict[str, tuple[Path, Any]]) -> None:
    path, _ = pretrained["mixtral"]
    skipped = "model.layers.1.block_sparse_moe.experts.2.w3.weight"
    weights = PretrainedWeights({"model": converted("mixtral")}, path,
                                lambda model, key: None if key == skipped else key, strict=True)
    with pytest.raises(CheckpointError) as error:
        weights.load()
    message = str(error.value)
    assert "1 missing (in the model, not in the files): model.layers.1.mlp.experts.w3 " \
           "(4, 32, 48) (the files lack 1 of its 4 tensors: " + skipped in message
    assert "unexpected" not in message


def test_an_expert_tensor_of_another_shape_is_refused(
        pretrained: dict[str, tuple[Path, Any]]) -> None:
    path, _ = pretrained["qwen3_moe"]
    model = converted("qwen3_moe")
    layer = model.model.layers[0].mlp
    layer.experts.w2 = torch.nn.Parameter(torch.zeros(4, 20, 32))  # hidden 20, files 24
    with pytest.raises(CheckpointError, match=r"shapes differ for model\.layers\.0\.mlp\."
                       r"experts\.0\.down_proj\.weight \(file \(32, 24\), slice 0 of "
                       r"model\.layers\.0\.mlp\.experts\.w2 \(4, 20, 32\): \(32, 20\)\)"):
        PretrainedWeights({"model": model}, path, lambda model, key: key, strict=True).load()


def test_a_model_type_without_a_layout_is_refused_for_moe_checkpoints(
        pretrained: dict[str, tuple[Path, Any]], tmp_path: Path) -> None:
    trainer = run("qwen3_moe", pretrained["qwen3_moe"][0], tmp_path, "one")
    checkpoint = trainer.checkpoint_dir / f"step_{trainer.global_step}"
    with pytest.raises(ValueError, match="model_type='olmoe' has no declared file layout for "
                       "its mixture-of-experts layers .*; the types with one are mixtral, "
                       "qwen3_moe"):
        export_checkpoint(checkpoint, tmp_path / "out", format="hf", model_type="olmoe")
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())
    # Without a model type the experts are written stacked, under the trainer's keys.
    export_checkpoint(checkpoint, tmp_path / "stacked", format="hf")
    assert "model.layers.0.mlp.experts.w1" in file_keys(tmp_path / "stacked")
