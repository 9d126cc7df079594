"""The command line: help, and export of a checkpoint."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file

from tests.helpers.checkpointing import CheckpointedTrainer, checkpointed_config
from tests.helpers.launch import REPO, child_env


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "dream_trainer", *args], env=child_env(),
                          cwd=REPO, capture_output=True, text=True, timeout=120)


def test_help_lists_the_commands() -> None:
    result = cli("--help")
    assert result.returncode == 0 and "export" in result.stdout
    assert "safetensors" in cli("export", "--help").stdout


def test_export_command_writes_loadable_weights(tmp_path: Path) -> None:
    trainer = CheckpointedTrainer(checkpointed_config(tmp_path, resume=None))
    trainer.fit()
    checkpoint = tmp_path / "ckpt/tests/run/checkpoints" / f"step_{trainer.global_step}"
    result = cli("export", str(checkpoint), str(tmp_path / "out"))
    assert result.returncode == 0, result.stderr
    assert f"model: {tmp_path / 'out' / 'model.safetensors'}" in result.stdout
    weights = load_file(tmp_path / "out" / "model.safetensors")
    for name, tensor in trainer.model.state_dict().items():
        assert torch.equal(weights[name], tensor)


def test_export_of_a_broken_checkpoint_fails_with_a_message(tmp_path: Path) -> None:
    (tmp_path / "step_3").mkdir()
    result = cli("export", str(tmp_path / "step_3"), str(tmp_path / "out"))
    assert result.returncode == 1
    assert "is not a complete dream_trainer checkpoint" in result.stderr
