"""A model whose state-dict hook renames its keys (torchtitan's fused q/k/v layer) checkpoints,
resumes bit for bit, exports and loads with ``init_weights_from``, under the names its hook
gives (2 ranks under FSDP2: tests/parallel/test_renamed_keys_fsdp.py).

torch's ``get_model_state_dict`` maps every key back to an attribute and failed on such a
model ("'FusedQKV' object has no attribute 'wq'"); ``dream_trainer.parallel.state_dict`` takes
the model's own state dict for it.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from dream_trainer.parallel.state_dict import (load_model_state_dict, model_state_dict,
                                               renames_keys)
from tests.helpers.fused_qkv import FusedModel, FusedTrainer, config


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


@pytest.mark.parametrize("copies", [False, True], ids=["views", "copies"])
def test_init_weights_from_loads_a_model_with_renamed_keys(tmp_path: Path,
                                                            copies: bool) -> None:
    """From a checkpoint and from its export (both keyed by the hook's names), every
    parameter equals the trained one; with copies, only the load hooks can have set the fused
    weights, so the test fails if they are not run."""
    trained = FusedTrainer(config(tmp_path / "trained", 2))
    trained.fit()
    export = Path(trained.export_weights(tmp_path / "export")["model"])
    for source in (trained.checkpoint_dir / "step_2", export):
        started = FusedTrainer(config(tmp_path / "started", 2, copies=copies).model_copy(
            update={"init_weights_from": source}))
        try:
            started.set_up()
            assert started.model.layers["0"].copies is copies
            for (name, mine), theirs in zip(started.model.named_parameters(),
                                            trained.model.parameters()):
                assert torch.equal(mine, theirs), (source.name, name)
            assert started.global_step == 0
        finally:
            started.teardown()
            started.world.shutdown()
