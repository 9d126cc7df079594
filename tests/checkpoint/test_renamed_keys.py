"""A model whose state-dict hook renames its keys (torchtitan's fused q/k/v layer) checkpoints
and resumes bit for bit, under the names its hook gives.

torch's ``get_model_state_dict`` maps every key back to an attribute and failed on such a
model ("'FusedQKV' object has no attribute 'wq'"); ``dream_trainer.parallel.state_dict`` takes
the model's own state dict for it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from dream_trainer.configs import CheckpointParameters, TrainingParameters
from dream_trainer.parallel.state_dict import (load_model_state_dict, model_state_dict,
                                               renames_keys)
from tests.helpers.checkpointing import CheckpointedConfig, CheckpointedTrainer


class FusedQKV(nn.Module):
    """One ``wqkv`` weight, saved and loaded as ``wq``, ``wk`` and ``wv`` by its hooks."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.wqkv = nn.Linear(dim, 3 * dim, bias=False)
        self._register_state_dict_hook(FusedQKV._split)
        self._register_load_state_dict_pre_hook(FusedQKV._fuse)

    @staticmethod
    def _split(module: nn.Module, state: dict[str, Any], prefix: str, metadata: Any) -> None:
        fused = state.pop(prefix + "wqkv.weight")
        for name, part in zip("qkv", fused.chunk(3)):
            state[f"{prefix}w{name}.weight"] = part

    @staticmethod
    def _fuse(state: dict[str, Any], prefix: str, *args: Any) -> None:
        names = [f"{prefix}w{name}.weight" for name in "qkv"]
        if all(name in state for name in names):  # else load_state_dict names what is missing
            state[prefix + "wqkv.weight"] = torch.cat([state.pop(name) for name in names])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.wqkv(x).chunk(3, -1)
        return q * k.sigmoid() + v


class FusedModel(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        self.layers = nn.ModuleDict({str(i): FusedQKV(config.in_features) for i in range(2)})
        self.head = nn.Linear(config.in_features, config.out_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers.values():
            x = layer(x)
        return self.head(x)


class FusedTrainer(CheckpointedTrainer):
    def configure_models(self) -> None:
        self.model = FusedModel(self.config)


def config(root: Path, steps: int, resume: Any = None) -> CheckpointedConfig:
    return CheckpointedConfig(
        project="fused", group="tests", experiment="run", n_samples=64, val_samples=8,
        training_parameters=TrainingParameters(n_epochs=1, train_batch_size=4,
                                               max_steps=steps),
        checkpoint_parameters=CheckpointParameters(root_dir=root, every_n_steps=2,
                                                   every_n_epochs=None, resume=resume))


def test_the_state_dict_has_the_hooks_names_and_loads_back() -> None:
    torch.manual_seed(0)
    model = FusedModel(config(Path("unused"), 1))
    assert renames_keys(model) and not renames_keys(nn.Linear(2, 2))
    state = model_state_dict(model)
    assert sorted(state) == sorted([f"layers.{i}.w{n}.weight" for i in range(2) for n in "qkv"]
                                   + ["head.weight", "head.bias"])
    other = FusedModel(config(Path("unused"), 1))
    load_model_state_dict(other, {key: value.clone() for key, value in state.items()})
    for (name, mine), theirs in zip(model.named_parameters(), other.parameters()):
        assert torch.equal(mine, theirs), name
    with pytest.raises(RuntimeError, match="Missing key"):
        load_model_state_dict(other, {"head.weight": state["head.weight"]})


def test_a_model_with_renamed_keys_resumes_bit_for_bit(tmp_path: Path) -> None:
    whole = FusedTrainer(config(tmp_path / "whole", 4))
    whole.fit()
    first = FusedTrainer(config(tmp_path / "resumed", 2))
    first.fit()
    checkpoint = first.checkpoint_dir / "step_2"
    resumed = FusedTrainer(config(tmp_path / "resumed", 4, resume=checkpoint))
    resumed.fit()
    assert resumed.global_step == whole.global_step == 4
    for (name, mine), theirs in zip(whole.model.named_parameters(),
                                    resumed.model.parameters()):
        assert torch.equal(mine, theirs), name
    # Not vacuous: the steps after the checkpoint moved the weights.
    assert not torch.equal(first.model.head.weight, whole.model.head.weight)


def test_a_model_with_renamed_keys_exports_under_the_hooks_names(tmp_path: Path) -> None:
    """An export in the Hugging Face layout holds the keys the hook writes, with the values
    of the trained weights."""
    from safetensors.torch import load_file

    trained = FusedTrainer(config(tmp_path / "trained", 2))
    trained.fit()
    expected = {name: param.detach().clone() for name, param in trained.model.named_parameters()}
    resumed = FusedTrainer(config(tmp_path / "resumed", 2,
                                  resume=trained.checkpoint_dir / "step_2"))
    try:
        resumed.set_up()
        exported = Path(resumed.export_weights(tmp_path / "export")["model"])
        names = sorted(model_state_dict(resumed.model))
    finally:
        resumed.teardown()
        resumed.world.shutdown()
    files = load_file(exported / "model.safetensors")
    assert sorted(files) == names and "layers.0.wk.weight" in names
    for layer in range(2):
        parts = expected[f"layers.{layer}.wqkv.weight"].chunk(3)
        for name, part in zip("qkv", parts):
            assert torch.equal(files[f"layers.{layer}.w{name}.weight"], part)
    assert torch.equal(files["head.weight"], expected["head.weight"])


def test_init_weights_from_refuses_a_model_with_renamed_keys_naming_the_way_that_works(
        tmp_path: Path) -> None:
    """Not supported yet: the initialization after the load could not tell which parameters
    the files set. ``resume=<checkpoint>`` with ``load_weights_only=True`` does it."""
    from dream_trainer.errors import CheckpointError

    trained = FusedTrainer(config(tmp_path / "trained", 2))
    trained.fit()
    checkpoint = trained.checkpoint_dir / "step_2"
    refused = FusedTrainer(config(tmp_path / "refused", 1).model_copy(
        update={"init_weights_from": checkpoint}))
    with pytest.raises(CheckpointError, match="a state-dict hook of it renames its keys"):
        refused.fit()
    started = FusedTrainer(config(tmp_path / "started", 2, resume=checkpoint).model_copy(
        update={"checkpoint_parameters": CheckpointParameters(
            root_dir=tmp_path / "started", every_n_steps=2, every_n_epochs=None,
            resume=checkpoint, load_weights_only=True)}))
    try:
        started.set_up()
        for (name, mine), theirs in zip(started.model.named_parameters(),
                                        trained.model.parameters()):
            assert torch.equal(mine, theirs), name
        assert started.global_step == 0
    finally:
        started.teardown()
        started.world.shutdown()
