"""Bad data: unexpected batches, failing and unequal loaders end clearly, never in a hang
or a half-updated checkpoint."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, Dataset

from dream_trainer.checkpoint.directory import complete_checkpoints
from tests.helpers.checkpointing import CheckpointedTrainer, checkpointed_config
from tests.helpers.launch import REPO, check, torchrun
from tests.helpers.toy import ToyTrainer, toy_config


def test_a_batch_of_an_unexpected_type_names_the_batch() -> None:
    class Strings(ToyTrainer):
        def configure_dataloaders(self) -> tuple[Any, None]:
            return ["not a tensor batch"] * 4, None

    with pytest.raises(ValueError) as info:
        Strings(toy_config()).fit()
    assert "raised on rank 0 of 1 (epoch 0, global step 0, batch 0)" in str(info.value.__notes__)


class FailsAt(Dataset[Any]):
    """80 samples; reading sample ``bad`` raises, as a corrupt file would."""

    def __init__(self, bad: int) -> None:
        generator = torch.Generator().manual_seed(0)
        self.x, self.y = torch.randn(80, 8, generator=generator), torch.randn(80, 4, generator=generator)
        self.bad = bad

    def __len__(self) -> int:
        return 80

    def __getitem__(self, index: int) -> tuple[torch.Tensor, ...]:
        if index == self.bad:
            raise OSError(f"cannot read sample {index}")
        return self.x[index], self.y[index], torch.tensor(index)


def test_a_loader_failing_mid_epoch_names_the_batch_and_saves_nothing_half_done(
        tmp_path: Path) -> None:
    class Failing(CheckpointedTrainer):
        def configure_dataloaders(self) -> tuple[Any, None]:
            # Sequential order, batch 4: sample 22 is in batch 5, the second micro-batch of
            # optimizer step 3 (gradient_accumulation_steps=2).
            return DataLoader(FailsAt(bad=22), batch_size=4), None

    config = checkpointed_config(tmp_path, resume=None, every_n_steps=1)
    with pytest.raises(OSError, match="cannot read sample 22") as info:
        Failing(config.model_copy(update={"shuffle": False})).fit()
    assert "while loading batch 5" in str(info.value.__notes__)
    steps = [c.step for c in complete_checkpoints(tmp_path / "ckpt/tests/run/checkpoints")]
    assert steps == [1, 2]  # step 3 never completed, so it was never saved


@pytest.mark.distributed
def test_ranks_with_unequal_loaders_agree_on_the_step_count() -> None:
    result = check(torchrun(REPO / "tests/scripts/unequal_loaders.py", timeout=120))
    # Rank 1 has 6 batches, rank 0 has 10: both run 6 steps per epoch.
    assert "rank=0 steps=12" in result.stdout and "rank=1 steps=12" in result.stdout
    assert "every rank runs 6" in result.stderr
