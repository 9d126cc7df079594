"""A shared checkpoint cannot run code: crafted pickles in .metadata or in a non-tensor item are
refused on every path that reads a checkpoint, and a user's own type loads only once trusted."""

from __future__ import annotations

import dataclasses
import io
import operator
import os
import pickle
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from dream_trainer.checkpoint import CheckpointError
from dream_trainer.checkpoint.directory import METADATA
from dream_trainer.cli import main
from tests.helpers.checkpointing import CheckpointedTrainer, checkpointed_config
from tests.helpers.crafted import rechecksum as rewrite_checksums

ITEM = "state.trainer.global_step"  # a non-tensor item every checkpoint has, read on resume


class _Payload:
    """Unpickling it runs a shell command (the attack)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return os.system, (f"touch {self.marker}",)


class _Disguised:
    """Unpickles to ``value`` after running the payload, so the load still looks normal."""

    def __init__(self, marker: Path, value: Any) -> None:
        self.marker, self.value = marker, value

    def __reduce__(self) -> tuple[Any, ...]:
        return operator.getitem, ((_Payload(self.marker), self.value), 1)


def poison_metadata(checkpoint: Path, marker: Path) -> None:
    metadata = pickle.loads((checkpoint / METADATA).read_bytes())  # our own file: trusted
    (checkpoint / METADATA).write_bytes(pickle.dumps(_Disguised(marker, metadata)))
    rewrite_checksums(checkpoint)


def poison_item(checkpoint: Path, marker: Path, fqn: str = ITEM) -> None:
    """Replace one non-tensor item by one that runs the payload and unpickles to its value."""
    def disguised(value: Any) -> bytes:
        crafted = io.BytesIO()
        torch.save(_Disguised(marker, value), crafted)
        return crafted.getvalue()
    replace_item(checkpoint, fqn, disguised)


def replace_item(checkpoint: Path, fqn: str, craft: Any, rechecksum: str | None = "all") -> None:
    """Replace one non-tensor item's bytes in its data file by ``craft(its value)``, shifting
    what follows, and rewrite the metadata (and the checksums, as an attacker would)."""
    from torch.distributed.checkpoint.metadata import MetadataIndex

    metadata = pickle.loads((checkpoint / METADATA).read_bytes())
    index = MetadataIndex(fqn)
    info = metadata.storage_data[index]
    data = (checkpoint / info.relative_path).read_bytes()
    value = torch.load(io.BytesIO(data[info.offset:info.offset + info.length]),
                       weights_only=False)
    blob = craft(value)
    shift = len(blob) - info.length
    (checkpoint / info.relative_path).write_bytes(
        data[:info.offset] + blob + data[info.offset + info.length:])
    for key, other in list(metadata.storage_data.items()):
        if other.relative_path == info.relative_path and other.offset > info.offset:
            metadata.storage_data[key] = dataclasses.replace(other, offset=other.offset + shift)
    metadata.storage_data[index] = dataclasses.replace(info, length=len(blob))
    (checkpoint / METADATA).write_bytes(pickle.dumps(metadata))
    if rechecksum is not None:
        rewrite_checksums(checkpoint, None if rechecksum == "all" else rechecksum)


@pytest.fixture(scope="module")
def clean(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A normal checkpoint of a one-epoch run (step_10)."""
    root = tmp_path_factory.mktemp("clean")
    config = checkpointed_config(root, resume=None, every_n_steps=None)
    CheckpointedTrainer(config.model_copy(update={
        "training_parameters": config.training_parameters.model_copy(update={"n_epochs": 1})
    })).fit()
    return root / "ckpt/tests/run/checkpoints/step_10"


@pytest.fixture(params=["metadata", "item"])
def attack(request: pytest.FixtureRequest, clean: Path,
           tmp_path: Path) -> tuple[str, Path, Path]:
    """(kind, poisoned checkpoint, marker file the payload would create)."""
    checkpoint = tmp_path / "shared" / "step_10"
    shutil.copytree(clean, checkpoint)
    marker = tmp_path / "pwned"
    (poison_metadata if request.param == "metadata" else poison_item)(checkpoint, marker)
    return request.param, checkpoint, marker


def refused_global(kind: str) -> str:
    """The refusal, naming the file (or the item) and the first global the pickle needs."""
    where = r"\.metadata" if kind == "metadata" else rf"\(item {ITEM}\)"
    return rf"{where} would unpickle _operator\.getitem, which is not an allowed type"


def test_the_attack_runs_code_when_read_without_the_allowlist(
        attack: tuple[str, Path, Path]) -> None:
    # The crafted files are a real attack: plain unpickling runs the payload and still
    # returns a usable value.
    kind, checkpoint, marker = attack
    from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex

    metadata = pickle.loads((checkpoint / METADATA).read_bytes())
    assert isinstance(metadata, Metadata)
    if kind == "item":
        info = metadata.storage_data[MetadataIndex(ITEM)]
        data = (checkpoint / info.relative_path).read_bytes()
        assert torch.load(io.BytesIO(data[info.offset:info.offset + info.length]),
                          weights_only=False) == 10
    assert marker.exists()


def test_resume_and_load_checkpoint_refuse_it(attack: tuple[str, Path, Path],
                                              tmp_path: Path) -> None:
    kind, checkpoint, marker = attack
    config = checkpointed_config(tmp_path / "resume", resume=checkpoint)
    with pytest.raises(CheckpointError, match=refused_global(kind)):
        CheckpointedTrainer(config).fit()
    assert not marker.exists()

    trainer = CheckpointedTrainer(checkpointed_config(tmp_path / "load", resume=None))
    try:
        trainer.set_up()
        with pytest.raises(CheckpointError, match=refused_global(kind)):
            trainer.load_checkpoint(checkpoint)
    finally:
        trainer.teardown()
        trainer.world.shutdown()
    assert not marker.exists()


def test_init_weights_from_and_export_refuse_it_or_never_read_it(
        attack: tuple[str, Path, Path], tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    # Both read the metadata and the model tensors only: a poisoned .metadata is refused; a
    # poisoned non-tensor item is never unpickled, and the weights load.
    kind, checkpoint, marker = attack
    config = checkpointed_config(tmp_path / "init", resume=None)
    trainer = CheckpointedTrainer(config.model_copy(update={"init_weights_from": checkpoint}))
    if kind == "metadata":
        with pytest.raises(CheckpointError, match=refused_global(kind)):
            trainer.fit()
    else:
        trainer.fit()
    assert not marker.exists()

    code = main(["export", str(checkpoint), str(tmp_path / "exported")])
    if kind == "metadata":
        assert code == 1
        assert "would unpickle _operator.getitem" in capsys.readouterr().err
    else:
        assert code == 0 and (tmp_path / "exported" / "model.safetensors").exists()
    assert not marker.exists()


class Budget:
    """A user's own type kept in checkpointed state."""

    def __init__(self, left: int) -> None:
        self.left = left


class Budgeted(CheckpointedTrainer):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.budget = Budget(7)

    def extra_state_dict(self) -> dict[str, Any]:
        return {**super().extra_state_dict(), "budget": self.budget}

    def load_extra_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_extra_state_dict(state_dict)
        self.budget = state_dict["budget"]


def test_a_user_type_in_state_loads_only_once_trusted(tmp_path: Path) -> None:
    first = checkpointed_config(tmp_path, every_n_steps=None)
    one_epoch = first.training_parameters.model_copy(update={"n_epochs": 1})
    trainer = Budgeted(first.model_copy(update={"training_parameters": one_epoch}))
    trainer.budget.left = 3
    trainer.fit()

    name = f"{__name__}.Budget"
    with pytest.raises(CheckpointError, match=f"would unpickle {name}, which is not an allowed "
                                              f"type.*trusted_globals=\\['{name}'\\]"):
        Budgeted(first).fit()  # resume="latest" finds step_10

    trusted = first.checkpoint_parameters.model_copy(update={"trusted_globals": [name]})
    resumed = Budgeted(first.model_copy(update={"checkpoint_parameters": trusted}))
    resumed.fit()
    assert resumed.budget.left == 3 and resumed.global_step == 30


# -- round 2: state changed through allowed classes, floods, stale checksums -----------------
def copy_of(clean: Path, tmp_path: Path) -> Path:
    checkpoint = tmp_path / "shared" / "step_10"
    shutil.copytree(clean, checkpoint)
    return checkpoint


def build_on_path_class(checkpoint: Path, target: Path, rechecksum: bool = True) -> None:
    """Prepend to .metadata the opcodes that BUILD ``pathlib.PurePosixPath`` itself: read by
    a stock unpickler, every path of the process then names ``target`` (so an export's clean-up
    of its staging directory deletes ``target``)."""
    state = str(target).encode()
    prefix = (b"\x80\x02cpathlib\nPurePosixPath\nN}X\x04\x00\x00\x00_strX"
              + len(state).to_bytes(4, "little") + state + b"s\x86b0")
    (checkpoint / METADATA).write_bytes(prefix + (checkpoint / METADATA).read_bytes())
    if rechecksum:
        rewrite_checksums(checkpoint)


def test_build_on_an_allowed_class_is_refused_everywhere_and_deletes_nothing(
        clean: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    checkpoint = copy_of(clean, tmp_path)
    precious = tmp_path / "precious"
    precious.mkdir()
    (precious / "data.txt").write_text("keep")
    build_on_path_class(checkpoint, precious)
    refused = r"cannot be read safely: it holds setting the state of pathlib\.PurePosixPath"

    for fmt in ("hf", "safetensors"):
        assert main(["export", str(checkpoint), str(tmp_path / f"out_{fmt}"),
                     "--format", fmt]) == 1
        assert "setting the state of pathlib.PurePosixPath" in capsys.readouterr().err
    config = checkpointed_config(tmp_path / "resume", resume=checkpoint)
    with pytest.raises(CheckpointError, match=refused):
        CheckpointedTrainer(config).fit()
    init = checkpointed_config(tmp_path / "init", resume=None)
    with pytest.raises(CheckpointError, match=refused):
        CheckpointedTrainer(init.model_copy(update={"init_weights_from": checkpoint})).fit()
    assert (precious / "data.txt").read_text() == "keep"
    assert str(Path("/home/user/run")) == "/home/user/run"


def test_a_stale_checksum_refuses_metadata_before_it_is_parsed(clean: Path,
                                                                tmp_path: Path) -> None:
    checkpoint = copy_of(clean, tmp_path)
    build_on_path_class(checkpoint, tmp_path / "precious", rechecksum=False)
    config = checkpointed_config(tmp_path / "resume", resume=checkpoint)
    # Named as altered, not as a refused pickle: the decoder never saw the bytes.
    with pytest.raises(CheckpointError, match=r"step_10/\.metadata does not match the "
                                              r"checksum recorded .* it was not parsed"):
        CheckpointedTrainer(config).fit()


def flooded_rank_blob(value: bytes) -> bytes:
    """A rank's packed blob whose pickle is a dict of 100,000 int keys with one hash, saved
    as DCP saves a blob (an archive holding the bytes)."""
    import zipfile

    p = 2**61 - 1
    items = b"".join(b"\x8a\x0a" + (1 + k * p).to_bytes(10, "little", signed=True) + b"K\x00"
                     for k in range(100_000))
    inner, out = zipfile.ZipFile(io.BytesIO(value)), io.BytesIO()
    with zipfile.ZipFile(out, "w") as crafted:
        for name in inner.namelist():
            crafted.writestr(name, b"\x80\x02}(" + items + b"u." if name.endswith("data.pkl")
                             else inner.read(name))
    outer = io.BytesIO()
    torch.save(out.getvalue(), outer)
    return outer.getvalue()


def test_a_flood_of_colliding_keys_in_an_item_is_refused_within_seconds(
        clean: Path, tmp_path: Path) -> None:
    import time

    checkpoint = copy_of(clean, tmp_path)
    replace_item(checkpoint, "state.rank0", flooded_rank_blob)
    config = checkpointed_config(tmp_path / "resume", resume=checkpoint)
    start = time.perf_counter()
    with pytest.raises(CheckpointError, match=r"item state\.rank0\) cannot be read safely: "
                                              r"it holds more than 64 keys of one dict"):
        CheckpointedTrainer(config).fit()
    # Generous: it takes well under a second; inserting the keys would take minutes.
    assert time.perf_counter() - start < 5


def test_a_stale_checksum_refuses_an_item_before_it_is_parsed(clean: Path,
                                                              tmp_path: Path) -> None:
    checkpoint = copy_of(clean, tmp_path)
    # The metadata is made to match; the data file holding the item is not.
    replace_item(checkpoint, "state.rank0", flooded_rank_blob, rechecksum=METADATA)
    config = checkpointed_config(tmp_path / "resume", resume=checkpoint)
    with pytest.raises(CheckpointError, match=r"__0_0\.distcp does not match the checksum "
                                              "recorded"):
        CheckpointedTrainer(config).fit()
