"""An export that cannot read a weight says which file and what is wrong, not DCP's
``CheckpointException ranks:dict_keys([0])``."""

from __future__ import annotations

import io
import shutil
from pathlib import Path

import pytest
import torch

from dream_trainer.checkpoint import CheckpointError, export_checkpoint
from dream_trainer.checkpoint.directory import MODEL_PREFIX
from tests.helpers.crafted import (metadata_of, one_epoch_checkpoint, packed, replace_stored,
                                   stored)


@pytest.fixture(scope="module")
def clean(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return one_epoch_checkpoint(tmp_path_factory.mktemp("clean"))


def _reshape_weight(checkpoint: Path) -> tuple[str, tuple[int, ...], tuple[int, ...]]:
    """Store one 2-d model weight transposed (same bytes, another shape), the metadata and
    checksums rewritten to match the file: (its key, the stored shape, the declared one)."""
    metadata = metadata_of(checkpoint)
    index = next(index for index in metadata.storage_data
                 if index.fqn.startswith(MODEL_PREFIX)
                 and len(set(metadata.state_dict_metadata[index.fqn].size)) == 2)
    weight = torch.load(io.BytesIO(stored(checkpoint, index)))
    replace_stored(checkpoint, index, packed(weight.t().contiguous()))
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


def test_a_resume_names_the_weight_stored_with_another_shape(clean: Path,
                                                            tmp_path: Path) -> None:
    from tests.helpers.checkpointing import CheckpointedTrainer, checkpointed_config

    checkpoint = tmp_path / "step_10"
    shutil.copytree(clean, checkpoint)
    key, stored, declared = _reshape_weight(checkpoint)
    trainer = CheckpointedTrainer(checkpointed_config(tmp_path / "run", resume=checkpoint))
    with pytest.raises(CheckpointError) as error:
        trainer.fit()
    # The reader's own refusal, as export and init_weights_from give it, not DCP's wrapper.
    assert str(error.value).startswith(
        f"checkpoint {checkpoint} (item {key}) holds a tensor of size {stored}, which does "
        f"not hold the part the metadata reads from it (offsets (0, 0), sizes {declared})")
