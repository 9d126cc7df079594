"""LoRA runs and their files, in one process: ``init_weights_from`` reads a base directory into
a peft model and an adapter folder on top of it to continue a fine-tune; ``dream-trainer
export --format peft`` writes a checkpoint's adapter as the run's own export does; bad
adapters and an adapter the layout cannot shard are refused by name."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from dream_trainer.cli import main as cli
from dream_trainer.errors import CheckpointError
from tests.helpers.hf import save_pretrained
from tests.scripts.lora_resume import LoraResume, config

CHECKPOINTS = Path("hf/tests/llama/checkpoints")


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A 4-step LoRA run on a saved base, its peft export and its checkpoints."""
    root = tmp_path_factory.mktemp("lora_sources")
    base = root / "base"
    save_pretrained("llama", base)
    trainer = LoraResume(config(base, root / "run", root / "run"))
    trainer.export_dir = root / "adapter"
    trainer.fit()
    return {"root": root, "base": base, "adapter": root / "adapter", "final": trainer.final,
            "checkpoint": root / "run" / CHECKPOINTS / "step_4"}


def adapters(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {name: value for name, value in weights.items() if ".lora_" in name}


def test_an_adapter_folder_continues_the_fine_tune(trained: dict[str, Any],
                                                   tmp_path: Path) -> None:
    trainer = LoraResume(config([trained["base"], trained["adapter"]], tmp_path, tmp_path / "c"))
    trainer.fit()
    initial, final = trainer.initial, trained["final"]
    assert initial.keys() == final.keys()
    for name, value in final.items():
        # The adapters as the first run ended them; the base as it was saved (frozen).
        assert torch.equal(initial[name], value), name
    moved = max(float((trainer.final[name] - value).abs().max())
                for name, value in adapters(final).items())
    assert moved > 1e-4  # and they train on


def test_export_format_peft_writes_the_checkpoint_s_adapter(trained: dict[str, Any],
                                                            tmp_path: Path,
                                                            capsys: pytest.CaptureFixture[str]
                                                            ) -> None:
    from peft import PeftModel
    from safetensors.torch import load_file

    out = tmp_path / "from_checkpoint"
    assert cli(["export", str(trained["checkpoint"]), str(out), "--format", "peft"]) == 0
    assert capsys.readouterr().out == f"model: {out}\n"
    assert sorted(path.name for path in out.iterdir()) == [
        "adapter_config.json", "adapter_model.safetensors"]
    live = load_file(trained["adapter"] / "adapter_model.safetensors")
    exported = load_file(out / "adapter_model.safetensors")
    assert exported.keys() == live.keys() and len(live) == 2 * 7 * 2
    for key, value in live.items():
        assert torch.equal(exported[key], value), key
    assert json.loads((out / "adapter_config.json").read_text()) == json.loads(
        (trained["adapter"] / "adapter_config.json").read_text())
    from tests.helpers.hf import build

    loaded = PeftModel.from_pretrained(build("llama"), str(out))
    for name, value in dict(loaded.named_parameters()).items():
        if ".lora_" in name:
            assert torch.equal(value.detach(), trained["final"][name]), name

    # The checkpoint has no base: a whole-model export is refused, naming what to do.
    assert cli(["export", str(trained["checkpoint"]), str(tmp_path / "hf"),
                "--format", "hf"]) == 1
    error = capsys.readouterr().err
    assert f"{trained['checkpoint']} leaves out the 21 frozen weights of model 'model' (they " \
           f"are read from {trained['base']} (checksum " in error
    assert "Export its adapter with --format peft" in error
    assert not (tmp_path / "hf").exists() or not any((tmp_path / "hf").iterdir())


def test_adapters_for_another_model_are_refused_by_name(trained: dict[str, Any],
                                                        tmp_path: Path) -> None:
    from peft import LoraConfig, get_peft_model

    from tests.helpers.hf import build
    from tests.scripts.lora_run import TARGETS

    # Another rank: the scaling (lora_alpha / r) and the shapes would differ.
    wide = tmp_path / "r8"
    get_peft_model(build("llama"), LoraConfig(r=8, lora_alpha=8, target_modules=TARGETS)) \
        .save_pretrained(str(wide))
    with pytest.raises(CheckpointError) as error:
        LoraResume(config([trained["base"], wide], tmp_path / "a", tmp_path / "a")).fit()
    assert str(error.value).startswith(
        f"{wide / 'adapter_config.json'} was saved for another adapter: r 8 (the model's 4)")
    # An adapter of another base (3 layers): its third layer's tensors fit nothing.
    deeper = tmp_path / "deeper"
    get_peft_model(build("llama", layers=3), LoraConfig(
        r=4, lora_alpha=8, lora_dropout=0.0, target_modules=TARGETS)).save_pretrained(str(deeper))
    with pytest.raises(CheckpointError) as error:
        LoraResume(config([trained["base"], deeper], tmp_path / "b", tmp_path / "b")).fit()
    message = str(error.value)
    assert message.startswith(f"init_weights_from={str(deeper)!r} does not fit model 'model': "
                              "14 unexpected (in the files, not in the model): ")
    assert "base_model.model.model.layers.2.self_attn.q_proj.lora_A.weight (4, 32)" in message


def test_an_adapter_the_tensor_parallel_plan_cannot_shard_is_refused() -> None:
    from peft import LoraConfig, get_peft_model
    from torch.distributed.tensor.parallel import SequenceParallel

    from dream_trainer.parallel.lora import lora_tensor_parallel_plan
    from tests.helpers.hf import build

    model = get_peft_model(build("llama"), LoraConfig(r=4, target_modules=["q_proj"]))
    layer = model.base_model.model.model.layers[0]
    with pytest.raises(ValueError) as error:
        lora_tensor_parallel_plan(layer, {"self_attn.q_proj": SequenceParallel()})
    assert str(error.value) == (
        "self_attn.q_proj is a LoRA layer under SequenceParallel: its adapters can follow "
        "ColwiseParallel or RowwiseParallel only; give its base one of them, or leave the "
        "layer out of the plan")
