"""Weights in and out of s3:// (moto's S3 server), in one process: ``init_weights_from`` a
Hugging Face folder and a dream_trainer checkpoint in the bucket, ``export_weights`` and
``dream-trainer export`` to the bucket (and from a checkpoint there), each export loaded back
with transformers' ``from_pretrained`` after a download; errors name the URL."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM

from dream_trainer.checkpoint import CheckpointError
from dream_trainer.checkpoint.storage import ObjectPath
from dream_trainer.cli import main as cli
from dream_trainer.configs import CheckpointParameters
from tests.helpers.hf import hf_config, save_pretrained
from tests.helpers.s3 import S3Server
from tests.scripts.hf_run import Run, RunConfig


def upload(s3: S3Server, local: Path, url: str) -> None:
    """Put every file of ``local`` under ``url`` with boto3 (not the library's client)."""
    prefix = url.split("/", 3)[3]
    for file in sorted(local.iterdir()):
        s3.client().upload_file(str(file), s3.bucket, f"{prefix}/{file.name}")


def download(s3: S3Server, url: str, local: Path) -> Path:
    """Every object directly under ``url``, into ``local``."""
    prefix = url.split("/", 3)[3] + "/"
    local.mkdir(parents=True)
    for key in s3.keys(prefix):
        if "/" not in key.removeprefix(prefix):
            s3.client().download_file(s3.bucket, key, str(local / key.removeprefix(prefix)))
    return local


def names(s3: S3Server, url: str) -> list[str]:
    prefix = url.split("/", 3)[3] + "/"
    return [key.removeprefix(prefix) for key in s3.keys(prefix)]


class Kept(Run):
    """Keeps the weights right after setup and at the end; exports from inside the run."""

    def post_setup(self) -> None:
        super().post_setup()
        self.loaded = clone(self.model)

    def post_fit(self) -> None:
        super().post_fit()
        self.trained = clone(self.model)


def clone(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {key: value.detach().clone() for key, value in model.state_dict().items()}


def start(source: str, root: str, export_dir: str, experiment: str = "run") -> Kept:
    base = hf_config(init_weights_from=source)
    trainer = Kept(RunConfig(**{**dict(base), "experiment": experiment},
                             checkpoint_parameters=CheckpointParameters(root_dir=root)))
    trainer.export_dir = export_dir  # type: ignore[assignment]
    trainer.fit()
    return trainer


def assert_equal(actual: dict[str, torch.Tensor], expected: dict[str, Any]) -> None:
    assert actual.keys() == expected.keys()
    for key, tensor in expected.items():
        assert torch.equal(actual[key], tensor), key


@pytest.mark.parametrize("shard", [None, "20KB"])
def test_init_weights_from_an_s3_hugging_face_folder_then_export_to_s3(
        s3: S3Server, s3_url: str, tmp_path: Path, shard: str | None) -> None:
    pretrained = save_pretrained("llama", tmp_path / "pretrained")
    if shard is not None:  # shards and model.safetensors.index.json
        pretrained.save_pretrained(tmp_path / "pretrained", max_shard_size=shard)
        (tmp_path / "pretrained/model.safetensors").unlink()
    upload(s3, tmp_path / "pretrained", f"{s3_url}/pretrained")
    trainer = start(f"{s3_url}/pretrained", f"{s3_url}/runs", f"{s3_url}/live")
    assert_equal(trainer.loaded, pretrained.state_dict())
    # export_weights from inside the run: uploaded whole, the ranks' slices cleaned up.
    assert trainer.exported == {"model": ObjectPath(f"{s3_url}/live")}
    assert names(s3, f"{s3_url}/live") == ["config.json", "generation_config.json",
                                           "model.safetensors"]
    reloaded = AutoModelForCausalLM.from_pretrained(download(s3, f"{s3_url}/live",
                                                             tmp_path / "live"))
    assert_equal(reloaded.state_dict(), trainer.trained)
    assert not torch.equal(trainer.trained["model.norm.weight"],
                           trainer.loaded["model.norm.weight"])  # the steps trained it
    with pytest.raises(FileExistsError, match=rf"export target {s3_url}/live is not empty "
                                              r"\(it holds config.json, generation_config"):
        trainer.export_weights(f"{s3_url}/live")


def test_init_weights_from_an_s3_checkpoint_and_export_command_from_and_to_s3(
        s3: S3Server, s3_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    save_pretrained("llama", tmp_path / "pretrained")
    first = start(str(tmp_path / "pretrained"), f"{s3_url}/runs", str(tmp_path / "live"))
    checkpoint = f"{s3_url}/runs/hf/tests/run/checkpoints/step_3"
    assert str(first.checkpoint_dir / "step_3") == checkpoint
    # A new run starts from the checkpoint in the bucket: exactly its final weights.
    second = start(checkpoint, f"{s3_url}/runs", str(tmp_path / "live2"), experiment="second")
    assert_equal(second.loaded, first.trained)

    # dream-trainer export from the bucket to the bucket, in shards, with the config.
    out = f"{s3_url}/exported"
    assert cli(["export", checkpoint, out, "--format", "hf", "--max-shard-size", "20KB",
                "--config-from", str(tmp_path / "pretrained")]) == 0
    sharded = names(s3, out)
    assert "model.safetensors.index.json" in sharded and "config.json" in sharded
    assert len([name for name in sharded if name.endswith(".safetensors")]) > 1
    # A non-empty target is refused, naming it; --overwrite replaces the weights only.
    s3.client().put_object(Bucket=s3.bucket, Key=f"{out.split('/', 3)[3]}/notes.txt",
                           Body=b"kept")
    capsys.readouterr()
    assert cli(["export", checkpoint, out, "--format", "hf"]) == 1
    assert f"export target {out} is not empty" in capsys.readouterr().err
    assert cli(["export", checkpoint, out, "--format", "hf", "--overwrite"]) == 0
    assert names(s3, out) == ["config.json", "generation_config.json", "model.safetensors",
                              "notes.txt"]
    reloaded = AutoModelForCausalLM.from_pretrained(download(s3, out, tmp_path / "exported"))
    assert_equal(reloaded.state_dict(), first.trained)

    # From the bucket to a local directory, one file per model.
    assert cli(["export", checkpoint, str(tmp_path / "plain")]) == 0
    from safetensors.torch import load_file

    assert_equal(load_file(tmp_path / "plain/model.safetensors"), first.trained)
    # --config-from keeps a private file private in a local target.
    (tmp_path / "pretrained/secret.json").write_text("{}")
    (tmp_path / "pretrained/secret.json").chmod(0o600)
    assert cli(["export", checkpoint, str(tmp_path / "hf"), "--format", "hf",
                "--config-from", str(tmp_path / "pretrained")]) == 0
    assert (tmp_path / "hf/secret.json").stat().st_mode & 0o777 == 0o600
    assert (tmp_path / "hf/config.json").is_file()


def test_unreachable_sources_and_targets_are_named_with_the_fix(
        s3: S3Server, s3_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(CheckpointError, match=r"init_weights_from='s3://no-such-bucket/w'.*"
                                              r"the bucket 'no-such-bucket' of "
                                              r"s3://no-such-bucket/w does not exist at the "
                                              rf"endpoint {s3.endpoint}"):
        start("s3://no-such-bucket/w", str(tmp_path / "runs"), str(tmp_path / "live"))
    with pytest.raises(CheckpointError, match=rf"init_weights_from='{s3_url}/absent' does not "
                                              r"exist \(nothing is stored under it\)"):
        start(f"{s3_url}/absent", str(tmp_path / "runs"), str(tmp_path / "live"))
    save_pretrained("llama", tmp_path / "pretrained")
    first = start(str(tmp_path / "pretrained"), str(tmp_path / "runs"), str(tmp_path / "live"))
    checkpoint = str(first.checkpoint_dir / "step_3")
    assert cli(["export", checkpoint, "s3://no-such-bucket/out", "--format", "hf"]) == 1
    assert ("error: cannot write s3://no-such-bucket/out: the bucket 'no-such-bucket' of "
            "s3://no-such-bucket/out does not exist") in capsys.readouterr().err


@pytest.mark.distributed
def test_fsdp2_on_2_ranks_reads_its_slices_from_s3_and_exports_there(
        s3: S3Server, s3_url: str, tmp_path: Path) -> None:
    from tests.helpers.launch import REPO, check, torchrun

    pretrained = save_pretrained("llama", tmp_path / "pretrained")
    upload(s3, tmp_path / "pretrained", f"{s3_url}/pretrained")
    size = (tmp_path / "pretrained/model.safetensors").stat().st_size
    check(torchrun(REPO / "tests/scripts/object_store_weights.py",
                   [str(tmp_path), f"{s3_url}/pretrained", f"{s3_url}/runs"], nproc=2))
    ranks = [torch.load(tmp_path / f"rank{rank}.pt", weights_only=False) for rank in (0, 1)]
    result = ranks[0]
    assert result["placements"]["model.layers.0.mlp.up_proj.weight"] == ["S(0)"]
    assert_equal(result["loaded"], pretrained.state_dict())
    # Each rank fetched about its half of the file (its rows of every tensor, the header
    # and 256-byte read-ahead blocks), not the whole of it.
    fetched = [sum(count for _, count in rank["fetched"]) for rank in ranks]
    print(f"fetched per rank: {fetched} of {size} bytes")
    assert all(0.45 * size < count < 0.65 * size for count in fetched), (fetched, size)
    # The export from inside the run, joined by rank 0 from both ranks' slices in the
    # bucket, loads in transformers as the trained weights.
    live = f"{s3_url}/runs/live"
    assert result["exported"] == {"model": live}
    assert names(s3, live) == ["config.json", "generation_config.json",
                                           "model.safetensors"]
    reloaded = AutoModelForCausalLM.from_pretrained(download(s3, live,
                                                             tmp_path / "live"))
    assert_equal(reloaded.state_dict(), result["trained"])
    # The second run started from the first one's checkpoint in the bucket, each rank
    # opening only the data file it wrote (the same layout).
    assert_equal(result["second_loaded"], result["trained"])
    assert [rank["second_opened"] for rank in ranks] == [["__0_0.distcp"], ["__1_0.distcp"]]
