"""Object-store URLs a run names (root_dir, resume, init_weights_from) are checked before the
models are built, against moto's S3 server: the bucket, the credentials, and for root_dir a
write and a delete; every error names the setting, the problem and the fix."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from dream_trainer.checkpoint import CheckpointError
from tests.helpers.checkpointing import CheckpointedTrainer, checkpointed_config
from tests.helpers.s3 import S3Server

RUN = "ckpt/tests/run/checkpoints"


class Recorded(CheckpointedTrainer):
    """Records the lifecycle points it reaches: the storage is checked in the configure
    phase's first step, after launch and before ``configure_models``."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.events: list[str] = []

    def pre_launch(self) -> None:
        super().pre_launch()
        self.events.append("pre_launch")

    def configure_models(self) -> None:
        self.events.append("configure_models")
        super().configure_models()


def refused(root: str | Path, **settings: Any) -> tuple[str, list[str]]:
    """The error a run with these settings fails with, and the points it reached."""
    weights = settings.pop("init_weights_from", None)
    config = checkpointed_config(root, **settings)  # type: ignore[arg-type]
    trainer = Recorded(config.model_copy(update={"init_weights_from": weights}))
    with pytest.raises(CheckpointError) as error:
        trainer.fit()
    return str(error.value), trainer.events


def test_a_missing_bucket_in_root_dir_fails_before_the_models_are_built(s3: S3Server) -> None:
    message, events = refused("s3://no-such-bucket/runs", resume=None)
    assert events == ["pre_launch"]  # configure_models never ran
    assert message == (
        "checkpoint_parameters.root_dir cannot hold this run's checkpoints: the bucket "
        f"'no-such-bucket' of s3://no-such-bucket/runs/{RUN} does not exist at the endpoint "
        f"{s3.endpoint} (AWS_ENDPOINT_URL): create it, or correct the URL (checked before "
        "the models are built)")


def test_missing_credentials_fail_before_the_models_are_built(
        s3: S3Server, s3_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_PROFILE",
                 "AWS_SESSION_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    # No file botocore could find credentials in either.
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    message, events = refused(s3_url, resume=None)
    assert events == ["pre_launch"]
    assert message.startswith("checkpoint_parameters.root_dir cannot hold this run's "
                              f"checkpoints: no credentials to reach {s3_url}/{RUN}: set "
                              "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or AWS_PROFILE) "
                              "in the environment")


def test_root_dir_is_written_and_cleaned_by_the_check(s3: S3Server, s3_url: str) -> None:
    # A resumable run that finds nothing starts fresh: the check's probe object is gone
    # and only the run's own objects remain.
    trainer = Recorded(checkpointed_config(s3_url, resume="latest"))  # type: ignore[arg-type]
    trainer.fit()
    assert trainer.events == ["pre_launch", "configure_models"]
    keys = s3.keys(f"{s3_url.split('/', 3)[3]}/")
    assert f"{s3_url.split('/', 3)[3]}/{RUN}/step_30/dream_trainer.json" in keys
    assert not [key for key in keys if ".dream_trainer_write_check" in key]


def test_a_resume_url_that_holds_no_checkpoint_fails_before_the_models_are_built(
        s3: S3Server, s3_url: str) -> None:
    target = f"{s3_url}/elsewhere/step_4"
    message, events = refused(s3_url, resume=target)
    assert events == ["pre_launch"]
    assert message == (f"resume={target!r}: no checkpoint directory there (use 'latest' to "
                       "continue this experiment)")
    message, events = refused(s3_url, resume="s3://no-such-bucket/x/step_4")
    assert events == ["pre_launch"]
    assert message.startswith("cannot read checkpoint_parameters.resume='s3://no-such-bucket/"
                              "x/step_4': the bucket 'no-such-bucket' of "
                              "s3://no-such-bucket/x/step_4 does not exist")


def test_a_local_resume_path_without_a_checkpoint_fails_before_the_models_are_built(
        tmp_path: Path) -> None:
    message, events = refused(tmp_path, resume=str(tmp_path / "step_4"))
    assert events == ["pre_launch"]
    assert message == (f"resume={str(tmp_path / 'step_4')!r}: no checkpoint directory there "
                       "(use 'latest' to continue this experiment)")


def test_init_weights_from_an_unreadable_url_fails_before_the_models_are_built(
        s3: S3Server, s3_url: str, tmp_path: Path) -> None:
    message, events = refused(tmp_path, resume=None, init_weights_from="s3://no-such-bucket/w")
    assert events == ["pre_launch"]
    assert message == ("cannot read init_weights_from='s3://no-such-bucket/w': the bucket "
                       "'no-such-bucket' of s3://no-such-bucket/w does not exist at the "
                       f"endpoint {s3.endpoint} (AWS_ENDPOINT_URL): create it, or correct the "
                       "URL")
    message, events = refused(tmp_path, resume=None,
                              init_weights_from={"model": f"{s3_url}/absent"})
    assert events == ["pre_launch"]
    assert message.startswith(f"init_weights_from='{s3_url}/absent' does not exist (nothing "
                              "is stored under it): give the URL of a Hugging Face weights "
                              "directory or of a dream_trainer checkpoint")
