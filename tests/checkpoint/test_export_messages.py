"""An export that cannot read a weight says which file and what is wrong, not DCP's
``CheckpointException ranks:dict_keys([0])``."""

from __future__ import annotations

import dataclasses
import io
import pickle
import shutil
from pathlib import Path

import pytest
import torch

from dream_trainer.checkpoint import CheckpointError, export_checkpoint
from dream_trainer.checkpoint.layout import METADATA, MODEL_PREFIX
from tests.checkpoint.test_safe_loading import _rechecksum
from tests.helpers.checkpointing import CheckpointedTrainer, checkpointed_config


@pytest.fixture(scope="module")
def clean(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("clean")
    config = checkpointed_config(root, resume=None, every_n_steps=None)
    CheckpointedTrainer(config.model_copy(update={
        "training_parameters": config.training_parameters.model_copy(update={"n_epochs": 1})
    })).fit()
    return root / "ckpt/tests/run/checkpoints/step_10"


def _reshape_weight(checkpoint: Path) -> tuple[str, tuple[int, ...], tuple[int, ...]]:
    """Store one 2-d model weight transposed (same bytes, another shape), the metadata and
    checksums rewritten to match the file: (its key, the stored shape, the declared one)."""
    metadata = pickle.loads((checkpoint / METADATA).read_bytes())  # our own file
    index, info = next((index, info) for index, info in metadata.storage_data.items()
                       if index.fqn.startswith(MODEL_PREFIX)
                       and len(metadata.state_dict_metadata[index.fqn].size) == 2
                       and len(set(metadata.state_dict_metadata[index.fqn].size)) == 2)
    data = (checkpoint / info.relative_path).read_bytes()
    weight = torch.load(io.BytesIO(data[info.offset:info.offset + info.length]))
    blob = io.BytesIO()
    torch.save(weight.t().contiguous(), blob)
    blob_bytes = blob.getvalue()
    shift = len(blob_bytes) - info.length
    (checkpoint / info.relative_path).write_bytes(
        data[:info.offset] + blob_bytes + data[info.offset + info.length:])
    for key, other in list(metadata.storage_data.items()):
        if other.relative_path == info.relative_path and other.offset > info.offset:
            metadata.storage_data[key] = dataclasses.replace(other, offset=other.offset + shift)
    metadata.storage_data[index] = dataclasses.replace(info, length=len(blob_bytes))
    (checkpoint / METADATA).write_bytes(pickle.dumps(metadata))
    _rechecksum(checkpoint)
    return index.fqn, tuple(weight.t().shape), tuple(weight.shape)


@pytest.mark.parametrize("format", ["safetensors", "hf"])
def test_a_weight_stored_with_another_shape_is_named(clean: Path, tmp_path: Path,
                                                     format: str) -> None:
    checkpoint = tmp_path / "step_10"
    shutil.copytree(clean, checkpoint)
    key, stored, declared = _reshape_weight(checkpoint)
    out = tmp_path / "out"
    with pytest.raises(CheckpointError) as error:
        export_checkpoint(checkpoint, out, format=format)  # type: ignore[arg-type]
    message = str(error.value)
    assert "CheckpointException" not in message and "ranks:" not in message
    assert f"(item {key}) holds a tensor of size {stored}, which does not hold the part the " \
           f"metadata reads from it (offsets (0, 0), sizes {declared})" in message
    assert str(checkpoint) in message
    assert not any(path.is_file() for path in out.rglob("*"))  # nothing half-written
