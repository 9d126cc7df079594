"""A 2-rank FSDP2 run writing its checkpoints to s3:// (moto's server), SIGKILLed before a
checkpoint and during an upload, rerun until done: it ends with the uninterrupted run's
weights, and the bucket never holds a checkpoint that resume="latest" would load partially;
the checkpoint then resumes on another layout."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dream_trainer.checkpoint.directory import (INFO, METADATA, complete_checkpoints, step_dirs,
                                                verify_files)
from dream_trainer.checkpoint.storage import ObjectPath, storage_for
from dream_trainer.checkpoint.trust import safe_reader
from tests.helpers.checkpointing import CheckpointedTrainer, checkpointed_config
from tests.helpers.launch import REPO, run_script
from tests.helpers.s3 import S3Server

SCRIPT = REPO / "tests/scripts/object_store_run.py"
# Two ranks: 5 optimizer steps an epoch, 3 epochs; saves at steps 4, 5, 8, 10, 12 and 15.
KILLS = ["step:6", "upload:8"]


def intact_or_incomplete(root: ObjectPath) -> list[int]:
    """The complete checkpoints' steps, after checking that each loads whole: all its files
    there, matching the checksums of its commit marker."""
    complete = complete_checkpoints(root)
    for info in complete:
        verify_files(info.path, safe_reader(str(info.path)).read_metadata())
    return [info.step for info in complete]


@pytest.mark.distributed
def test_fsdp2_run_killed_anywhere_on_s3_ends_as_the_uninterrupted_one(
        s3: S3Server, s3_url: str, tmp_path: Path) -> None:
    whole = run_script(SCRIPT, 2, f"{s3_url}/whole", tmp_path / "whole.pt", "--keep-top-k", "2")
    assert whole.returncode == 0, whole.stderr[-3000:]
    root = ObjectPath(f"{s3_url}/killed/ckpt/tests/run/checkpoints")
    args = [f"{s3_url}/killed", tmp_path / "killed.pt", "--keep-top-k", "2", "--async-save",
            "--markers", tmp_path, "--kill", *KILLS]
    # Killed after step 6: step 4 is committed; step 5's async save was committed only at
    # the next save, which never came, so resume="latest" does not see it.
    first = run_script(SCRIPT, 2, *args)
    assert first.returncode != 0 and (tmp_path / "step_6").exists()
    assert intact_or_incomplete(root) == [4]
    # Resumed from step 4, saved 5 again, then killed during the upload of step 8: its data
    # and .metadata are in the bucket, its commit marker is not, so resume="latest" ignores
    # it and step 5 stays resumable.
    second = run_script(SCRIPT, 2, *args)
    assert second.returncode != 0 and (tmp_path / "upload_8").exists()
    storage = storage_for(root)
    assert storage.is_file(root / "step_8" / METADATA)
    assert not storage.is_file(root / "step_8" / INFO)
    assert intact_or_incomplete(root) == [4, 5]
    third = run_script(SCRIPT, 2, *args)
    assert third.returncode == 0, third.stderr[-3000:]
    assert f"skipping {root}/step_8: it was not completely written" in third.stderr
    # keep_top_k=2 kept the two newest; the abandoned step_8 was deleted with the others.
    assert intact_or_incomplete(root) == [12, 15]
    assert [step for step, _ in step_dirs(root)] == [12, 15]
    assert not storage.is_file(root / ".lock")
    expected, actual = torch.load(tmp_path / "whole.pt"), torch.load(tmp_path / "killed.pt")
    assert actual["step"] == expected["step"] == 15
    assert expected["weights"].keys() == actual["weights"].keys()
    for name, tensor in expected["weights"].items():
        assert torch.equal(actual["weights"][name], tensor), name
    # Another layout resumes from the bucket: one process, no FSDP, reads both ranks' shards
    # (twice the accumulation keeps the global batch).
    config = checkpointed_config(f"{s3_url}/one",  # type: ignore[arg-type]
                                 resume=f"{root}/step_15")
    training = config.training_parameters.model_copy(update={"gradient_accumulation_steps": 4})
    single = CheckpointedTrainer(config.model_copy(
        update={"rank_state": False, "training_parameters": training}))
    single.fit()
    assert single.global_step == 15
    for name, tensor in single.model.state_dict().items():
        assert torch.equal(tensor, expected["weights"][name]), name
