"""transformers MoE models as transformers builds them (their blocks not converted): a tiny
Qwen3-MoE and Mixtral load their ``save_pretrained`` folders with ``init_weights_from`` (the
per-expert file tensors stacked into ``experts.gate_up_proj`` and ``experts.down_proj``, as
``from_pretrained`` stacks them), fine-tune, and export (live and from a checkpoint) what
``from_pretrained`` loads into exactly the trained weights. The 2-rank FSDP2 load is the
``fsdp_asis`` layout of ``test_hf_moe_checkpoints.py``'s launch."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM

from dream_trainer.checkpoint import CheckpointError, export_checkpoint
from dream_trainer.checkpoint.pretrained import PretrainedWeights
from dream_trainer.cli import main as cli
from tests.helpers.hf import fixed_batch, logits
from tests.scripts.hf_moe_run import build, run, save_pretrained

FAMILIES = ("qwen3_moe", "mixtral")


def file_keys(directory: Path) -> set[str]:
    with safe_open(str(directory / "model.safetensors"), "pt") as file:
        return set(file.keys())


def assert_same_weights(loaded: torch.nn.Module, model: torch.nn.Module) -> None:
    expected = model.state_dict()
    got = loaded.state_dict()
    assert got.keys() == expected.keys()
    for key, value in expected.items():
        assert torch.equal(got[key], value), key


@pytest.mark.parametrize("family", FAMILIES)
def test_the_unconverted_model_loads_trains_and_exports_as_transformers_does(
        family: str, tmp_path: Path) -> None:
    path = tmp_path / "pretrained"
    reference = save_pretrained(family, path)  # type: ignore[arg-type]
    trainer = run(family, path, tmp_path, "one_asis")  # type: ignore[arg-type]
    block = trainer.model.model.layers[0].mlp
    assert block.experts.gate_up_proj.shape[0] == 4  # transformers' own block, stacked
    # The same weights as from_pretrained's, so the same computation: bit for bit.
    loaded = AutoModelForCausalLM.from_pretrained(path)
    assert torch.equal(trainer.initial, logits(loaded, fixed_batch()))
    assert torch.equal(trainer.initial, logits(reference, fixed_batch()))
    assert (trainer.final - trainer.initial).abs().max() > 0.1  # the steps moved the weights
    checkpoint = trainer.checkpoint_dir / f"step_{trainer.global_step}"
    assert cli(["export", str(checkpoint), str(tmp_path / "cli"), "--format", "hf",
                "--config-from", str(path)]) == 0
    for exported in (tmp_path / f"live_{family}_one_asis", tmp_path / "cli"):
        # The layout save_pretrained writes, one tensor per expert, and nothing else.
        assert file_keys(exported) == file_keys(path)
        loaded = AutoModelForCausalLM.from_pretrained(exported)
        assert_same_weights(loaded, trainer.model)
        assert torch.equal(logits(loaded, fixed_batch()), trainer.final)


def test_without_a_model_type_the_export_keeps_the_stacked_experts(tmp_path: Path) -> None:
    """transformers' own keys, which from_pretrained loads as they are."""
    path = tmp_path / "pretrained"
    save_pretrained("qwen3_moe", path)
    trainer = run("qwen3_moe", path, tmp_path, "one_asis")
    checkpoint = trainer.checkpoint_dir / f"step_{trainer.global_step}"
    export_checkpoint(checkpoint, tmp_path / "stacked", format="hf")
    assert "model.layers.0.mlp.experts.gate_up_proj" in file_keys(tmp_path / "stacked")
    shutil.copy(path / "config.json", tmp_path / "stacked")
    assert_same_weights(AutoModelForCausalLM.from_pretrained(tmp_path / "stacked"),
                        trainer.model)


def test_a_model_type_without_a_declared_layout_is_named(tmp_path: Path) -> None:
    path = tmp_path / "pretrained"
    save_pretrained("qwen3_moe", path)
    model: Any = build("qwen3_moe")
    model.config.model_type = "olmoe"  # the same blocks, a type with no declared layout
    with pytest.raises(CheckpointError) as error:
        PretrainedWeights({"model": model}, path, lambda name, key: key, strict=True).load()
    message = str(error.value)
    assert "model.layers.0.mlp.experts.gate_up_proj (4, 48, 32)" in message
    assert "read the files' one tensor per expert only for the model types declared in " \
           "dream_trainer.nn.hf_moe.FILE_LAYOUTS (mixtral, qwen3_moe)" in message
    assert json.loads((path / "config.json").read_text())["model_type"] == "qwen3_moe"
