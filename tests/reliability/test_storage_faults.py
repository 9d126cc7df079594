"""Storage faults during a save: a clear error, intact training state, the last complete
checkpoint still the one resume loads."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from dream_trainer.checkpoint import CheckpointError, export_checkpoint
from dream_trainer.checkpoint.directory import complete_checkpoints, step_dirs
from tests.helpers.checkpointing import (CheckpointedTrainer, assert_same_state,
                                         checkpointed_config, final_state)

STEPS = "ckpt/tests/run/checkpoints"


class Recording(CheckpointedTrainer):
    """Remembers the state right before each save attempt."""

    def save_checkpoint(self, asynchronous: bool | None = None) -> Path:
        self.before_save = final_state(self)
        return super().save_checkpoint(asynchronous)


def fit_until_failure(root: Path, **checkpoint: Any) -> tuple[Recording, CheckpointError]:
    trainer = Recording(checkpointed_config(root, resume=None, **checkpoint))
    with pytest.raises(CheckpointError) as info:
        trainer.fit()
    return trainer, info.value


def assert_resume_uses(root: Path, step: int) -> None:
    assert [info.step for info in complete_checkpoints(root / STEPS)][-1] == step
    assert set(export_checkpoint(root / STEPS / f"step_{step}", root / "export")) == {"model"}


def test_injected_disk_full_during_the_second_save(tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    import torch.distributed.checkpoint as dcp

    real_save, calls = dcp.save, []

    def full_disk(state: Any, checkpoint_id: str, **kwargs: Any) -> Any:
        calls.append(checkpoint_id)
        if len(calls) == 2:
            (Path(checkpoint_id) / "__0_0.distcp").write_bytes(b"partial")
            raise OSError(28, "No space left on device")
        return real_save(state, checkpoint_id=checkpoint_id, **kwargs)

    monkeypatch.setattr(dcp, "save", full_disk)
    trainer, error = fit_until_failure(tmp_path)
    assert "could not write checkpoint" in str(error) and "step_8" in str(error)
    assert "No space left on device" in str(error)
    assert f"resume would use {tmp_path / STEPS / 'step_4'}" in str(error)
    # The failed save changed nothing in memory.
    assert_same_state(final_state(trainer), trainer.before_save)
    assert 8 in {step for step, _ in step_dirs(tmp_path / STEPS)}  # partial, left behind
    assert_resume_uses(tmp_path, 4)


def test_read_only_checkpoint_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Root ignores file modes, so the refusal is injected where the directory is created.
    real_mkdir = Path.mkdir

    def read_only(self: Path, *args: Any, **kwargs: Any) -> None:
        if self.name == "step_8":
            raise PermissionError(13, "Read-only file system", str(self))
        real_mkdir(self, *args, **kwargs)

    monkeypatch.setattr(Path, "mkdir", read_only)
    trainer, error = fit_until_failure(tmp_path)
    assert "Read-only file system" in str(error)
    assert_same_state(final_state(trainer), trainer.before_save)
    assert_resume_uses(tmp_path, 4)


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A real 260 KiB file system: room for one checkpoint of the model below, not two."""
    mount = tmp_path / "disk"
    mount.mkdir()
    result = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=260k", "tmpfs", str(mount)],
                            capture_output=True, text=True)
    if result.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({result.stderr.strip()}); the injected "
                    "disk-full test covers the same path")
    try:
        yield mount
    finally:
        subprocess.run(["umount", str(mount)], check=False)


def test_real_disk_full(small_disk: Path) -> None:
    config = checkpointed_config(small_disk, resume=None, keep_top_k=1)
    trainer = Recording(config.model_copy(update={"hidden": 512}))
    with pytest.raises(CheckpointError) as info:
        trainer.fit()
    # torch's writer reports the short write in its own words; the free space says why.
    assert "could not write checkpoint" in str(info.value) and "step_8" in str(info.value)
    assert "bytes free on its device" in str(info.value)
    assert_same_state(final_state(trainer), trainer.before_save)
    complete = complete_checkpoints(small_disk / STEPS)
    assert [c.step for c in complete] == [4]
    export = small_disk.parent / "export"
    assert set(export_checkpoint(complete[0].path, export)) == {"model"}


def test_latest_skips_a_checkpoint_with_a_truncated_shard(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    import logging

    caplog.set_level(logging.INFO, logger="dream_trainer")
    CheckpointedTrainer(checkpointed_config(tmp_path, resume=None)).fit()
    shard = tmp_path / STEPS / "step_30" / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[:64])
    resumed = CheckpointedTrainer(checkpointed_config(tmp_path, resume="latest"))
    resumed.fit()
    assert "skipping" in caplog.text and "__0_0.distcp is truncated" in caplog.text
    assert f"resumed from {tmp_path / STEPS / 'step_28'}" in caplog.text
    assert resumed.global_step == 30


def test_a_flipped_byte_is_detected_skipped_by_latest_and_named_by_load_and_export(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    import logging

    caplog.set_level(logging.INFO, logger="dream_trainer")
    CheckpointedTrainer(checkpointed_config(tmp_path, resume=None)).fit()
    newest = tmp_path / STEPS / "step_30"
    shard = newest / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01  # same length: only a checksum can tell
    shard.write_bytes(bytes(data))
    message = r"__0_0.distcp does not match the checksum recorded when the checkpoint was written"
    with pytest.raises(CheckpointError, match=message):
        export_checkpoint(newest, tmp_path / "export")
    with pytest.raises(CheckpointError, match=message):
        CheckpointedTrainer(checkpointed_config(tmp_path, resume=newest)).fit()
    resumed = CheckpointedTrainer(checkpointed_config(tmp_path, resume="latest"))
    resumed.fit()
    assert "skipping" in caplog.text and "does not match the checksum" in caplog.text
    assert f"resumed from {tmp_path / STEPS / 'step_28'}" in caplog.text
    assert resumed.global_step == 30
