"""Adapter-sized checkpoints: a LoRA run whose base comes from ``init_weights_from`` checkpoints
the adapters, their optimizer state and the run state, and records the base (its paths and
a checksum of its files); a SIGKILLed run resumes bit for bit on 2 ranks (FSDP2) and in one
process from such a checkpoint; a changed base is refused by name; ``save_frozen_weights``
keeps the full state."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from tests.helpers.checkpointing import assert_same_weights as assert_same
from tests.helpers.launch import REPO, check, run_script, torchrun

pytestmark = pytest.mark.distributed

SCRIPT = REPO / "tests/scripts/lora_resume.py"
CHECKPOINTS = Path("hf/tests/llama/checkpoints")


def one_process(*args: str | Path) -> subprocess.CompletedProcess[str]:
    return run_script(SCRIPT, 1, *args, timeout=300)


def size(directory: Path) -> int:
    return sum(path.stat().st_size for path in directory.iterdir())


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.helpers.hf import save_pretrained

    path = tmp_path_factory.mktemp("lora_base") / "base"
    save_pretrained("llama", path)
    return path


def test_a_killed_lora_run_resumes_bit_exactly_from_an_adapter_sized_checkpoint(
        tmp_path: Path, base: Path) -> None:
    markers = tmp_path / "markers"
    markers.mkdir()
    check(torchrun(SCRIPT, [str(base), str(tmp_path / "straight"), str(tmp_path / "straight")],
                   timeout=300))
    killed = torchrun(SCRIPT, [str(base), str(tmp_path / "killed"), str(tmp_path / "killed"),
                               "--kill", "step:3", "--markers", str(markers)], timeout=300)
    assert killed.returncode != 0 and (markers / "step_3").exists()
    step2 = tmp_path / "killed" / CHECKPOINTS / "step_2"
    assert not (step2.parent / "step_4").exists()
    record = json.loads((step2 / "models.json").read_text())
    frozen = record["frozen"]["model"]
    assert frozen["paths"] == [str(base)]
    # Every base weight (2 layers x 9, the norm, the embedding and the head) is left out and
    # no adapter is.
    assert len(frozen["keys"]) == 2 * 9 + 3
    assert not any(".lora_" in key for key in frozen["keys"])
    assert record["adapters"]["model"]["default"]["r"] == 4
    saved = json.loads((step2 / "dream_trainer.json").read_text())["files"]
    assert "models.json" in saved  # checksummed with the rest
    shutil.copytree(tmp_path / "killed", tmp_path / "to_one")  # the same checkpoint, for 1
    check(torchrun(SCRIPT, [str(base), str(tmp_path / "killed"), str(tmp_path / "resumed")],
                   timeout=300))
    straight = {tag: torch.load(tmp_path / f"straight.{tag}") for tag in ("step2", "final")}
    assert straight["final"]["global_step"] == 4
    assert_same(torch.load(tmp_path / "resumed.loaded"), straight["step2"])
    assert_same(torch.load(tmp_path / "resumed.final"), straight["final"])

    # A layout change: the FSDP2 checkpoint resumes in one process with exactly its state.
    check(one_process(base, tmp_path / "to_one", tmp_path / "one"))
    assert_same(torch.load(tmp_path / "one.loaded"), straight["step2"])
    assert torch.load(tmp_path / "one.final")["global_step"] == 4

    # The size on disk against the full state's (save_frozen_weights=True), both written by
    # one process at step 4: the full state holds the base's bytes more (and a longer
    # metadata); the adapter-sized one none of them.
    check(one_process(base, tmp_path / "full", tmp_path / "full", "--full-state"))
    full = tmp_path / "full" / CHECKPOINTS / "step_4"
    assert json.loads((full / "models.json").read_text())["frozen"] == {}
    adapter_sized = tmp_path / "to_one" / CHECKPOINTS / "step_4"
    base_bytes = sum(path.stat().st_size for path in base.glob("*.safetensors"))
    assert size(full) - size(adapter_sized) >= base_bytes - 4096, (size(full),
                                                                  size(adapter_sized))


def test_a_changed_base_is_refused_by_name_and_a_missing_one_is_read_again(
        tmp_path: Path, base: Path) -> None:
    from dream_trainer.errors import CheckpointError
    from tests.helpers.hf import save_pretrained
    from tests.scripts.lora_resume import LoraResume, config

    root = tmp_path / "root"
    LoraResume(config(base, root, tmp_path / "first")).fit()  # 4 steps: step_2 and step_4
    shutil.rmtree(root / CHECKPOINTS / "step_4")
    other = tmp_path / "other"
    save_pretrained("llama", other, seed=1)  # the same shapes and keys, other values
    with pytest.raises(CheckpointError) as error:
        LoraResume(config(other, root, tmp_path / "other_run")).fit()
    message = str(error.value)
    assert message.startswith(
        f"checkpoint {root / CHECKPOINTS / 'step_2'} leaves out the frozen weights of model "
        f"'model', which came from {base} (checksum ")
    assert f"but this run's are {other} (checksum " in message
    assert "the trained weights only fit the base they were trained on" in message

    # No init_weights_from: the resume reads the base from the recorded source.
    LoraResume(config(None, root, tmp_path / "again")).fit()
    first, again = (torch.load(tmp_path / f"{run}.final") for run in ("first", "again"))
    assert_same(again, first)

    # The recorded source altered in place: refused, naming it.
    shutil.rmtree(root / CHECKPOINTS / "step_4")
    shutil.copy(other / "model.safetensors", base / "model.safetensors")
    try:
        with pytest.raises(CheckpointError, match=f"which came from {base} "):
            LoraResume(config(None, root, tmp_path / "altered")).fit()
    finally:
        save_pretrained("llama", base)  # the module's base again, for other tests
