"""Paths a checkpoint, an export or a config names stay where they belong: a checkpoint reads
only regular files inside itself that a checksum covers; an export writes only inside
OUT_DIR; a Hugging Face folder fills every element it claims to; run names and seeds are
checked when the config is built; and every damaged file is named in the error."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import pickle
import re
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from pydantic import ValidationError
from safetensors.torch import load_file, save_file

from dream_trainer import AbstractTrainerConfig
from dream_trainer.checkpoint import CheckpointError, CheckpointInfo, export_checkpoint
from dream_trainer.checkpoint.directory import INFO, METADATA, checksum, verify_files
from dream_trainer.cli import main
from dream_trainer.configs import apply_cli_overrides
from tests.helpers.checkpointing import CheckpointedTrainer, checkpointed_config
from tests.helpers.toy import ToyTrainer, toy_config, toy_model

STEPS = "ckpt/tests/run/checkpoints"
DATA = "__0_0.distcp"  # the one data file a one-process checkpoint has


@pytest.fixture(scope="module")
def run_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A one-epoch run's root: checkpoints step_4, step_8 and step_10."""
    root = tmp_path_factory.mktemp("run")
    train(root, resume=None)
    return root


def train(root: Path, **checkpoint: Any) -> CheckpointedTrainer:
    config = checkpointed_config(root, **checkpoint)
    trainer = CheckpointedTrainer(config.model_copy(update={
        "training_parameters": config.training_parameters.model_copy(update={"n_epochs": 1})}))
    trainer.fit()
    return trainer


@pytest.fixture
def checkpoint(run_root: Path, tmp_path: Path) -> Path:
    """A private copy of step_10, to damage."""
    copy = tmp_path / "shared" / "step_10"
    shutil.copytree(run_root / STEPS / "step_10", copy)
    return copy


def read_metadata(checkpoint: Path) -> Any:
    return pickle.loads((checkpoint / METADATA).read_bytes())  # our own file: trusted


def write_metadata(checkpoint: Path, metadata: Any) -> None:
    """Write crafted metadata and update dream_trainer.json's checksums as an attacker would,
    so that only the checks under test stand in the way."""
    (checkpoint / METADATA).write_bytes(pickle.dumps(metadata))
    info = json.loads((checkpoint / INFO).read_text())
    info["files"] = {name: checksum(checkpoint / name) for name in info["files"]}
    (checkpoint / INFO).write_text(json.dumps(info))


def point_data_at(checkpoint: Path, name: str) -> None:
    """Make every entry of the metadata read from ``name`` instead of the data file."""
    metadata = read_metadata(checkpoint)
    for index, info in metadata.storage_data.items():
        metadata.storage_data[index] = dataclasses.replace(info, relative_path=name)
    write_metadata(checkpoint, metadata)


def rename_model(checkpoint: Path, name: str) -> None:
    """Store the model's tensors under the model name ``name``."""
    metadata = read_metadata(checkpoint)

    def renamed(key: str) -> str:
        return key.replace("state.models.model.", f"state.models.{name}.", 1)

    metadata.state_dict_metadata = {renamed(key): value
                                    for key, value in metadata.state_dict_metadata.items()}
    metadata.storage_data = {dataclasses.replace(index, fqn=renamed(index.fqn)): info
                             for index, info in metadata.storage_data.items()}
    write_metadata(checkpoint, metadata)


def snapshot(directory: Path) -> dict[str, str]:
    """Every entry under ``directory``: a file's SHA-256, a link's target."""
    found = {}
    for path in sorted(directory.rglob("*")):
        key = str(path.relative_to(directory))
        if path.is_symlink():
            found[key] = f"-> {os.readlink(path)}"
        elif path.is_file():
            found[key] = hashlib.sha256(path.read_bytes()).hexdigest()
    return found


# -- files a checkpoint names -------------------------------------------------------------------
@pytest.mark.parametrize(("name", "problem"), [
    ("../outside.distcp", "contains a path separator"),
    ("/ABSOLUTE", "is an absolute path"),
    ("..", "is '..'"),
    ("a\0b", "contains a NUL character"),
])
def test_a_file_name_leaving_the_checkpoint_is_refused(checkpoint: Path, name: str,
                                                       problem: str, tmp_path: Path) -> None:
    # The file the name reaches holds the checkpoint's own data, so that reading it would
    # load: the name is the only thing wrong.
    name = name.replace("/ABSOLUTE", str(tmp_path / "outside.distcp"))
    shutil.copy(checkpoint / DATA, tmp_path / "shared" / "outside.distcp")
    shutil.copy(checkpoint / DATA, tmp_path / "outside.distcp")
    point_data_at(checkpoint, name)
    expected = re.escape(f".metadata names the file {name!r}, which {problem}")
    with pytest.raises(CheckpointError, match=expected):
        verify_files(checkpoint, read_metadata(checkpoint))
    # The whole export, whichever check of the reader meets the name first.
    out = tmp_path / "out"
    with pytest.raises(CheckpointError) as error:
        export_checkpoint(checkpoint, out)
    assert repr(name)[1:-1] in str(error.value) or name in str(error.value)
    assert not out.exists()


@pytest.mark.parametrize("linked", [DATA, "config.json", METADATA])
def test_a_symlinked_checkpoint_file_is_refused(checkpoint: Path, linked: str,
                                                tmp_path: Path) -> None:
    # The link leads to a byte-identical copy, so every checksum still matches.
    outside = tmp_path / f"outside{linked}"
    (checkpoint / linked).replace(outside)
    (checkpoint / linked).symlink_to(outside)
    metadata = pickle.loads(outside.read_bytes()) if linked == METADATA \
        else read_metadata(checkpoint)
    with pytest.raises(CheckpointError, match=rf"{linked} is a symbolic link \(to {outside}\)"):
        verify_files(checkpoint, metadata)


def test_a_file_no_checksum_covers_is_refused(checkpoint: Path) -> None:
    shutil.copy(checkpoint / DATA, checkpoint / "extra.distcp")
    point_data_at(checkpoint, "extra.distcp")
    with pytest.raises(CheckpointError, match=r"extra\.distcp is covered by none of the "
                                              r"checksums that .*dream_trainer\.json recorded"):
        verify_files(checkpoint, read_metadata(checkpoint))


@pytest.mark.parametrize(("contents", "problem"), [
    ("not json", "JSONDecodeError"),
    ("[10, 0]", "a JSON list, not an object"),
    ('{"epoch": 0}', "'step' is None, not a step count"),
    ('{"step": 10, "epoch": 0, "files": [".metadata"]}', "'files' is not an object"),
])
def test_a_damaged_dream_trainer_json_is_named(checkpoint: Path, contents: str,
                                               problem: str) -> None:
    (checkpoint / INFO).write_text(contents)
    with pytest.raises(CheckpointError, match=rf"step_10/dream_trainer\.json cannot be read "
                                              rf"\({problem}"):
        CheckpointInfo.read(checkpoint)


@pytest.mark.parametrize("damaged", [INFO, METADATA])
def test_latest_skips_a_damaged_newest_checkpoint_and_resumes_the_older_one(
        run_root: Path, tmp_path: Path, damaged: str,
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="dream_trainer")
    shutil.copytree(run_root, tmp_path, dirs_exist_ok=True)
    (tmp_path / STEPS / "step_10" / damaged).write_text("not what it should be")
    resumed = train(tmp_path, resume="latest")
    skipped = next(record.getMessage() for record in caplog.records
                   if record.getMessage().startswith("skipping"))
    assert "step_10" in skipped and damaged in skipped
    assert f"resumed from {tmp_path / STEPS / 'step_8'} at global step 8" in caplog.text
    assert resumed.global_step == 10


def test_retention_keeps_a_checkpoint_it_cannot_read(run_root: Path, tmp_path: Path) -> None:
    from dream_trainer.checkpoint.retention import rotate
    from dream_trainer.configs import CheckpointParameters

    shutil.copytree(run_root, tmp_path, dirs_exist_ok=True)
    (tmp_path / STEPS / "step_4" / INFO).write_text("not json")
    rotate(tmp_path / STEPS, CheckpointParameters(keep_top_k=1), None)
    assert sorted(path.name for path in (tmp_path / STEPS).iterdir()) == ["step_10", "step_4"]


def test_a_config_json_that_is_not_json_is_named_before_the_state_loads(
        run_root: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="dream_trainer")
    shutil.copytree(run_root, tmp_path, dirs_exist_ok=True)
    checkpoint = tmp_path / STEPS / "step_8"
    (checkpoint / "config.json").write_text("{not json")
    write_metadata(checkpoint, read_metadata(checkpoint))  # its checksum recomputed
    shutil.rmtree(tmp_path / STEPS / "step_10")
    train(tmp_path, resume="latest")
    messages = [record.getMessage() for record in caplog.records]
    warning = next(index for index, message in enumerate(messages)
                   if message.startswith("not comparing the config"))
    assert f"{checkpoint / 'config.json'} cannot be read: JSONDecodeError" in messages[warning]
    assert warning < next(index for index, message in enumerate(messages)
                          if message.startswith("resumed from"))


# -- export writes only inside OUT_DIR ----------------------------------------------------------
@pytest.mark.parametrize("format", ["safetensors", "hf"])
@pytest.mark.parametrize("model", ["ABSOLUTE", "../x"])
def test_export_refuses_model_names_that_leave_out_dir(checkpoint: Path, tmp_path: Path,
                                                       model: str, format: str) -> None:
    victim = tmp_path / "victim"
    victim.mkdir()
    save_file({"w": torch.ones(2)}, str(victim / "x.safetensors"))
    (victim / "keep.txt").write_text("mine")
    if model == "ABSOLUTE":
        model = str(victim / "x")
        assert "." not in model  # a model name ends at the first dot of its keys
    rename_model(checkpoint, model)
    before = snapshot(tmp_path)
    out = tmp_path / "out"
    # "../x" stored as "state.models.../x.<key>" reads back as the model "" (empty).
    shown = model if model.startswith("/") else ""
    with pytest.raises(CheckpointError, match=rf"names the model {shown!r}, which .*nothing "
                                              r"was written"):
        export_checkpoint(checkpoint, out, format=format)  # type: ignore[arg-type]
    assert snapshot(tmp_path) == before


def test_hf_export_into_a_non_empty_dir_needs_overwrite_and_touches_nothing_outside(
        checkpoint: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out, sibling = tmp_path / "out", tmp_path / "sibling"
    out.mkdir()
    sibling.mkdir()
    save_file({"w": torch.ones(2)}, str(out / "unrelated.safetensors"))
    (out / "notes.txt").write_text("kept")
    save_file({"w": torch.zeros(2)}, str(sibling / "other.safetensors"))
    (sibling / "partial").mkdir()
    (sibling / "partial" / "keep.safetensors").write_text("kept")
    # Links planted where the export writes lead out of OUT_DIR; they are replaced, never
    # written through.
    (out / ".model.partial").symlink_to(sibling / "partial")
    (out / "model.safetensors").symlink_to(sibling / "other.safetensors")
    outside, inside = snapshot(sibling), snapshot(out)

    with pytest.raises(FileExistsError, match=rf"export target {out} is not empty .*"
                                              r"overwrite=True \(--overwrite"):
        export_checkpoint(checkpoint, out, format="hf")
    assert main(["export", str(checkpoint), str(out), "--format", "hf"]) == 1
    assert "is not empty" in capsys.readouterr().err
    assert snapshot(out) == inside and snapshot(sibling) == outside

    assert main(["export", str(checkpoint), str(out), "--format", "hf", "--overwrite"]) == 0
    assert sorted(path.name for path in out.iterdir()) == ["model.safetensors", "notes.txt"]
    assert not (out / "model.safetensors").is_symlink()
    assert set(load_file(out / "model.safetensors")) == {"0.weight", "0.bias", "3.weight",
                                                         "3.bias"}
    assert (out / "notes.txt").read_text() == "kept"
    assert snapshot(sibling) == outside


def test_config_from_copies_regular_files_and_never_follows_a_link(
        checkpoint: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pretrained, private = tmp_path / "pretrained", tmp_path / "private.key"
    pretrained.mkdir()
    (pretrained / "config.json").write_text('{"model_type": "toy"}')
    private.write_text("secret")
    (pretrained / "tokenizer.json").symlink_to(private)
    out = tmp_path / "out"
    assert main(["export", str(checkpoint), str(out), "--format", "hf",
                 "--config-from", str(pretrained)]) == 0
    assert sorted(path.name for path in out.iterdir()) == ["config.json", "model.safetensors"]
    assert f"skipped {pretrained / 'tokenizer.json'}: it is a symbolic link" \
        in capsys.readouterr().err


def test_export_weights_during_a_run_needs_overwrite_for_a_non_empty_dir(
        tmp_path: Path) -> None:
    trainer = ToyTrainer(toy_config(max_steps=1))
    trainer.fit()
    out = tmp_path / "exported"
    assert trainer.export_weights(out) == {"model": out}
    first = snapshot(out)
    assert sorted(first) == ["model.safetensors"]
    with pytest.raises(FileExistsError, match=rf"export target {out} is not empty"):
        trainer.export_weights(out)
    assert snapshot(out) == first
    assert trainer.export_weights(out, overwrite=True) == {"model": out}
    assert sorted(snapshot(out)) == ["model.safetensors"]


# -- Hugging Face folders -----------------------------------------------------------------------
def hf_folder(path: Path, **change: Any) -> Path:
    """A toy model's weights in the Hugging Face layout, with ``change`` applied: ``tensors``
    (replaced tensors), ``metadata`` (extra header entries), ``truncate`` (bytes cut)."""
    torch.manual_seed(0)
    tensors = {key: value.detach().clone()
               for key, value in toy_model(toy_config()).state_dict().items()}
    tensors.update(change.get("tensors", {}))
    path.mkdir()
    save_file(tensors, str(path / "model.safetensors"),
              metadata={"format": "pt", **change.get("metadata", {})})
    if "truncate" in change:
        data = (path / "model.safetensors").read_bytes()
        (path / "model.safetensors").write_bytes(data[:-change["truncate"]])
    return path


def load_into_toy(path: Path) -> ToyTrainer:
    trainer = ToyTrainer(toy_config(max_steps=1).model_copy(update={"init_weights_from": path}))
    trainer.fit()
    return trainer


def test_a_chunk_that_leaves_a_row_unwritten_is_refused_naming_the_tensor(
        tmp_path: Path) -> None:
    # The first layer's weight is [16, 8]; the file holds rows 1-15, placed at row 1: loaded
    # unchecked, row 0 kept the NaN of an uninitialized parameter.
    whole = toy_model(toy_config()).state_dict()
    offsets = {key: [0] * value.dim() for key, value in whole.items()}
    offsets["0.weight"] = [1, 0]
    path = hf_folder(tmp_path / "partial",
                     tensors={"0.weight": torch.randn(15, 8)},
                     metadata={"DCP_SHARDING_INFO": json.dumps(
                         {key: {"saved_offsets": value} for key, value in offsets.items()})})
    with pytest.raises(CheckpointError, match=rf"the chunks of tensor '0\.weight' \[16, 8\] in "
                                              rf"{path / 'model.safetensors'} hold 120 of its "
                                              r"128 elements"):
        load_into_toy(path)


@pytest.mark.parametrize(("change", "problem"), [
    ({"tensors": {"0.bias": torch.zeros(16, dtype=torch.uint16)}},
     r"model\.safetensors holds 0\.bias as U16, a dtype this reader does not read"),
    ({"truncate": 100}, r"model\.safetensors is not a readable safetensors file \(.*\): it is "
                        r"truncated"),
    ({"metadata": {"DCP_SHARDING_INFO": "[1, 2]"}},
     r"model\.safetensors has a DCP_SHARDING_INFO entry .* that does not give every tensor's "
     r"saved_offsets"),
])
def test_an_unreadable_safetensors_file_is_named(tmp_path: Path, change: dict[str, Any],
                                                 problem: str) -> None:
    path = hf_folder(tmp_path / "hf", **change)
    with pytest.raises(CheckpointError, match=rf"{tmp_path}/hf/{problem}"):
        load_into_toy(path)


@pytest.mark.parametrize("index", ["[1, 2]", "{not json", '{"metadata": {}}'])
def test_an_index_that_is_not_one_is_named(tmp_path: Path, index: str) -> None:
    path = hf_folder(tmp_path / "hf")
    (path / "model.safetensors").rename(path / "model-00001-of-00001.safetensors")
    (path / "model.safetensors.index.json").write_text(index)
    with pytest.raises(CheckpointError, match=rf"{path}/model\.safetensors\.index\.json "
                                              r"(is not|cannot be read as) a safetensors index"):
        load_into_toy(path)


# -- run names and seeds ------------------------------------------------------------------------
@pytest.mark.parametrize(("field", "value", "problem"), [
    ("experiment", "../../../x", "contains a path separator"),
    ("experiment", "/tmp/elsewhere", "is an absolute path"),
    ("group", "..", "is '..', a directory itself or its parent rather than an entry in it"),
    ("project", "a\0b", "contains a NUL character"),
])
def test_run_names_are_plain_directory_names(field: str, value: str, problem: str) -> None:
    names = {"project": "p", "group": "g", "experiment": "e", field: value}
    with pytest.raises(ValidationError, match=re.escape(f"{field}={value!r} {problem}: ")
                       + ".*must be a plain name"):
        AbstractTrainerConfig(**names)


def test_a_run_name_from_the_command_line_is_checked() -> None:
    with pytest.raises(ValidationError) as error:
        apply_cli_overrides(toy_config(), ["--experiment", "../../x"])
    assert [problem["loc"] for problem in error.value.errors()] == [("experiment",)]
    assert "contains a path separator" in str(error.value)


@pytest.mark.parametrize("seed", [2**64, 2**63, -2**63 - 1])
def test_a_seed_no_generator_takes_is_refused_when_the_config_is_built(seed: int) -> None:
    with pytest.raises(ValidationError, match=rf"seed={seed} is outside the range every "
                                              r"generator accepts, -2\*\*63 to 2\*\*63 - 1"):
        toy_config(seed=seed)
    # Both ends of the range are accepted, and seed a sampler's generator (seed + epoch).
    for edge in (2**63 - 1, -2**63):
        assert toy_config(seed=edge).seed == edge
        torch.Generator().manual_seed(edge + 100)
