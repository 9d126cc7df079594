"""Checkpoints at s3:// URLs, in one process, against moto's S3 server: the storage seam,
completeness, checksums, retention, async save, errors naming the URL, the run lock, and
reading through the allowlist."""

from __future__ import annotations

import json
import logging
import os
import pickle
import subprocess
import sys
from dataclasses import asdict, replace
from typing import Any

import pytest

from dream_trainer.callbacks import Callback
from dream_trainer.checkpoint import CheckpointError
from dream_trainer.checkpoint.directory import (INFO, METADATA, CheckpointInfo,
                                                complete_checkpoints, step_dirs, verify_files)
from dream_trainer.checkpoint.lock import LockHolder
from dream_trainer.checkpoint.object_store import ObjectLock, ObjectStorage
from dream_trainer.checkpoint.storage import ObjectPath, location, storage_for
from dream_trainer.checkpoint.trust import safe_reader
from dream_trainer.configs import CheckpointParameters
from tests.helpers.checkpointing import (CheckpointedTrainer, assert_same_state,
                                         checkpointed_config, final_state)
from tests.helpers.launch import REPO, child_env
from tests.helpers.s3 import S3Server

RUN = "ckpt/tests/run/checkpoints"


def train(url: str, epochs: int = 1, callbacks: tuple[Callback, ...] = (),
          **checkpoint: Any) -> CheckpointedTrainer:
    config = checkpointed_config(url, **checkpoint)  # type: ignore[arg-type]
    config = config.model_copy(update={"training_parameters": config.training_parameters
                                       .model_copy(update={"n_epochs": epochs})})
    trainer = CheckpointedTrainer(config)
    for callback in callbacks:
        trainer.callbacks.append(callback)
    trainer.callbacks.attach(trainer)
    trainer.fit()
    return trainer


def checkpoints(url: str) -> ObjectPath:
    return ObjectPath(f"{url}/{RUN}")


def keys(s3: S3Server, url: str) -> list[str]:
    """The bucket's keys under ``url``'s checkpoints, relative to them."""
    prefix = f"{url.split('/', 3)[3]}/{RUN}/"
    return [key.removeprefix(prefix) for key in s3.keys(prefix)]


def test_config_keeps_urls_and_paths_apart() -> None:
    params = CheckpointParameters(root_dir="s3://bucket/runs", resume="s3://bucket/x/step_4")
    again = CheckpointParameters.model_validate_json(params.model_dump_json())
    assert (again.root_dir, again.resume) == ("s3://bucket/runs", "s3://bucket/x/step_4")
    assert location(again.root_dir) / "a" == ObjectPath("s3://bucket/runs/a")
    local = CheckpointParameters(root_dir="outputs", resume="runs/step_4")
    assert isinstance(location(local.root_dir), os.PathLike)
    assert str(local.resume) == "runs/step_4"
    assert isinstance(storage_for(location("s3://bucket/runs")), ObjectStorage)


def test_storage_operations_on_the_server(s3: S3Server, s3_url: str) -> None:
    root = location(s3_url)
    storage = storage_for(root)
    storage.write_bytes(root / "step_1" / "a.bin", b"abc")
    storage.write_bytes(root / "step_1" / "sub" / "b.bin", b"de")
    assert storage.list_dir(root / "step_1") == [("a.bin", False), ("sub", True)]
    assert storage.list_dir(root / "absent") == []
    assert storage.is_dir(root / "step_1") and not storage.is_file(root / "step_1")
    assert storage.file_size(root / "step_1" / "a.bin") == 3
    with pytest.raises(CheckpointError, match=r"checkpoint file .*absent.bin is missing"):
        storage.file_size(root / "step_1" / "absent.bin")
    with pytest.raises(CheckpointError, match="not a regular file"):
        storage.file_size(root / "step_1" / "sub")
    # A name read from a checkpoint never reaches outside it, in an object store too.
    with pytest.raises(CheckpointError, match="contains a path separator"):
        storage.entry_size(root / "step_1", "../step_2/a.bin", root / "step_1" / METADATA)
    storage.remove_tree(root / "step_1")
    assert s3.keys(s3_url.split("/", 3)[3]) == []


def test_save_resume_checksums_and_keep_top_k(s3: S3Server, s3_url: str,
                                              tmp_path: Any) -> None:
    # A file beside the checkpoints that retention must leave alone.
    storage_for(location(s3_url)).write_bytes(checkpoints(s3_url) / "notes.txt", b"mine")
    trainer = train(s3_url, epochs=2, every_n_steps=3, keep_top_k=2, resume=None)
    local = train(str(tmp_path), epochs=2, every_n_steps=3, keep_top_k=2, resume=None)
    assert_same_state(final_state(trainer), final_state(local))
    # Steps 3, 6, 9, 10, 12, 15, 18, 20 were saved; the two newest are kept.
    names = keys(s3, s3_url)
    assert sorted({name.split("/")[0] for name in names}) == ["notes.txt", "step_18",
                                                               "step_20"]
    assert ".lock" not in names  # released at teardown
    infos = complete_checkpoints(checkpoints(s3_url))
    assert [info.step for info in infos] == [18, 20]
    newest = infos[-1]
    assert newest.files is not None and {METADATA, "config.json", "__0_0.distcp"} <= set(
        newest.files)
    verify_files(newest.path, safe_reader(str(newest.path)).read_metadata())
    # A resume continues from the newest and ends where the uninterrupted run ended.
    resumed = train(s3_url, epochs=2, every_n_steps=3, keep_top_k=2, resume="latest")
    assert resumed.global_step == 20 and resumed.current_epoch == 2


def test_a_damaged_or_incomplete_checkpoint_is_skipped(s3: S3Server, s3_url: str,
                                                       caplog: pytest.LogCaptureFixture) -> None:
    train(s3_url, every_n_steps=4, resume=None)
    root = checkpoints(s3_url)
    storage = storage_for(root)
    # The newest (step 10) altered after its commit; step 8 written but never committed.
    data = root / "step_10" / "__0_0.distcp"
    original = storage.read_bytes(data)
    storage.write_bytes(data, original[:-1] + bytes([original[-1] ^ 1]))
    storage.fs.rm_file((root / "step_8" / INFO).url)
    assert [info.step for info in complete_checkpoints(root)] == [4, 10]
    with pytest.raises(CheckpointError, match=r"step_10/__0_0.distcp does not match the checksum"):
        CheckpointedTrainer(checkpointed_config(
            s3_url, resume=f"{root}/step_10")).fit()  # type: ignore[arg-type]
    with pytest.raises(CheckpointError, match="step_8 is not a complete checkpoint"):
        CheckpointedTrainer(checkpointed_config(
            s3_url, resume=f"{root}/step_8")).fit()  # type: ignore[arg-type]
    with caplog.at_level(logging.INFO, logger="dream_trainer"):
        resumed = train(s3_url, epochs=1, every_n_steps=4, resume="latest")
    assert f"skipping {root}/step_10: checkpoint file {root}/step_10/__0_0.distcp does not " \
        "match" in caplog.text
    assert f"resumed from {root}/step_4 at global step 4" in caplog.text
    assert resumed.global_step == 10


def test_async_save_uploads_off_the_training_thread(s3: S3Server, s3_url: str) -> None:
    synchronous = train(f"{s3_url}/sync", every_n_steps=2, resume=None)
    asynchronous = train(f"{s3_url}/async", every_n_steps=2, resume=None, async_save=True)
    assert_same_state(final_state(asynchronous), final_state(synchronous))
    steps = [info.step for info in complete_checkpoints(checkpoints(f"{s3_url}/async"))]
    assert steps == [2, 4, 6, 8, 10]
    assert [step for step, _ in step_dirs(checkpoints(f"{s3_url}/async"))] == steps


def test_missing_bucket_is_named_with_the_fix(s3: S3Server) -> None:
    with pytest.raises(CheckpointError) as error:
        train("s3://no-such-bucket/runs", every_n_steps=4, resume=None)
    message = str(error.value)
    # Found before the models are built (tests/checkpoint/s3/test_early_checks.py).
    assert message.startswith("checkpoint_parameters.root_dir cannot hold this run's "
                              "checkpoints: the bucket 'no-such-bucket' of "
                              "s3://no-such-bucket/runs/ckpt/tests/run/checkpoints")
    assert "the bucket 'no-such-bucket'" in message and "does not exist" in message
    assert f"the endpoint {s3.endpoint} (AWS_ENDPOINT_URL)" in message
    assert "create it, or correct the URL" in message


class StopServer(Callback):
    """Stops the S3 server after optimizer step ``step``, before its checkpoint."""

    def __init__(self, s3: S3Server, step: int) -> None:
        self.s3, self.step = s3, step

    def post_train_batch(self, result: dict[str, Any], batch_idx: int) -> None:
        if not self.trainer.is_accumulating_gradients and self.trainer.global_step == self.step:
            self.s3.stop()


def test_server_stopped_mid_run_then_restarted_resumes(s3: S3Server, s3_url: str,
                                                       caplog: pytest.LogCaptureFixture) -> None:
    expected = final_state(train(f"{s3_url}/whole", every_n_steps=4, resume=None))
    try:
        with pytest.raises(CheckpointError) as error:
            train(s3_url, every_n_steps=4, resume=None, callbacks=(StopServer(s3, 8),))
    finally:
        s3.start()
    message = str(error.value)
    assert f"could not write checkpoint {checkpoints(s3_url)}/step_8" in message
    assert f"cannot reach the endpoint {s3.endpoint} (AWS_ENDPOINT_URL)" in message
    assert "check the network and the endpoint" in message
    root = checkpoints(s3_url)
    assert [info.step for info in complete_checkpoints(root)] == [4]
    verify_files(root / "step_4", safe_reader(str(root / "step_4")).read_metadata())
    with caplog.at_level(logging.INFO, logger="dream_trainer"):
        resumed = train(s3_url, every_n_steps=4, resume="latest")
    assert f"resumed from {root}/step_4 at global step 4" in caplog.text
    assert_same_state(final_state(resumed), expected)


HOLD = """
import sys
from dream_trainer.checkpoint.object_store import ObjectLock
from dream_trainer.checkpoint.storage import location, storage_for
root = location(sys.argv[1])
lock = ObjectLock(storage_for(root), root)
lock.acquire()
print("held", flush=True)
sys.stdin.read()
lock.release()
"""


def test_second_writer_is_refused_by_a_conditional_write(s3: S3Server, s3_url: str) -> None:
    root = checkpoints(s3_url)
    storage = storage_for(root)
    assert isinstance(storage, ObjectStorage)
    # Another live run (a process of its own) holds the lock while this one tries.
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(root)], env=child_env(),
                              cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "held\n"
        with pytest.raises(CheckpointError) as error:
            train(s3_url, resume=None)
        assert f"another run holds the lock on {root}: pid {holder.pid} on host" \
            in str(error.value)
        assert f"delete {root}/.lock if that run is gone" in str(error.value)
    finally:
        holder.communicate("", timeout=60)
    assert holder.returncode == 0 and keys(s3, s3_url) == []
    # A lock left by a dead process of this machine is taken over; one held on another
    # host is refused, since whether it still runs cannot be checked.
    dead = replace(LockHolder.this_process(), pid=2**22 + 1, launcher_pid=1)
    storage.write_bytes(root / ".lock", json.dumps(asdict(dead)).encode())
    taken = ObjectLock(storage, root)
    taken.acquire()
    assert LockHolder.parse(storage.read_bytes(root / ".lock").decode()) == taken.holder
    taken.release()
    elsewhere = replace(dead, host="other-host", boot_id="another-boot")
    storage.write_bytes(root / ".lock", json.dumps(asdict(elsewhere)).encode())
    with pytest.raises(CheckpointError, match="on host other-host.*on another host, so whether"):
        ObjectLock(storage, root).acquire()


class Exploit:
    """Unpickling this would run code: a checkpoint must never do it."""

    def __reduce__(self) -> tuple[Any, ...]:
        return os.system, ("touch /tmp/dream-trainer-s3-exploit",)


def test_a_crafted_metadata_object_is_never_unpickled(s3: S3Server, s3_url: str) -> None:
    train(s3_url, every_n_steps=4, resume=None)
    step = checkpoints(s3_url) / "step_10"
    storage = storage_for(step)
    storage.write_bytes(step / METADATA, pickle.dumps(Exploit()))
    # Without recorded checksums the allowlist alone stands between the file and its code.
    info = CheckpointInfo.read(step)
    replace(info, files=None).write()
    with pytest.raises(CheckpointError, match=r"step_10/.metadata.*posix.system"):
        safe_reader(str(step)).read_metadata()
    assert not os.path.exists("/tmp/dream-trainer-s3-exploit")
