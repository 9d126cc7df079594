"""User state in checkpoints: any structure round-trips, keys absent from an older
checkpoint arrive missing, state declared shared must be shared, load failures are named."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from dream_trainer.checkpoint import CheckpointError
from tests.helpers.checkpointing import CheckpointedTrainer, checkpointed_config
from tests.helpers.launch import REPO, torchrun


class Structured(CheckpointedTrainer):
    """Extra state of nested, growing structures; version 2 adds a key."""

    version = 1

    def extra_state_dict(self) -> dict[str, Any]:
        state = {**super().extra_state_dict(),
                 "losses": [torch.tensor(float(step)) for step in range(self.global_step)],
                 "nested": {"steps": list(range(self.global_step)), "name": "run"}}
        if self.version == 2:
            state["added_later"] = "new"
        return state

    def load_extra_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_extra_state_dict(state_dict)
        self.loaded = state_dict


def test_growing_structures_and_a_key_an_older_checkpoint_lacks_load_as_saved(
        tmp_path: Path) -> None:
    Structured(checkpointed_config(tmp_path, resume=None).model_copy(
        update={"training_parameters": checkpointed_config(tmp_path).training_parameters
                .model_copy(update={"max_steps": 6})})).fit()
    later = Structured(checkpointed_config(tmp_path, resume="latest"))
    later.version = 2
    later.fit()
    # The loaded lists are those of step 6, although the trainer's own had other lengths.
    assert [float(t) for t in later.loaded["losses"]] == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
    assert later.loaded["nested"] == {"steps": [0, 1, 2, 3, 4, 5], "name": "run"}
    assert "added_later" not in later.loaded  # missing, so a default can apply
    assert later.global_step == 30


class SameModelNewOptimizerState(CheckpointedTrainer):
    def configure_optimizers(self) -> None:
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.1, momentum=0.9)


def test_a_load_failure_inside_dcp_is_a_checkpoint_error_naming_key_and_rank(
        tmp_path: Path) -> None:
    config = checkpointed_config(tmp_path, resume=None)
    plain_sgd = config.model_copy(update={"optimizer": "sgd"})
    CheckpointedTrainer(plain_sgd).fit()  # SGD without momentum keeps no per-parameter state
    step = tmp_path / "ckpt/tests/run/checkpoints/step_30"
    with pytest.raises(CheckpointError, match=r"failed to load checkpoint .*step_30: rank 0: "
                                              r".*state\.optimizers\.optimizer\.state\."
                                              r".*momentum_buffer"):
        SameModelNewOptimizerState(checkpointed_config(tmp_path, resume=step)).fit()


@pytest.mark.distributed
def test_extra_state_that_differs_by_rank_is_refused_at_save_naming_the_key(
        tmp_path: Path) -> None:
    result = torchrun(REPO / "tests/scripts/shared_state_run.py", [str(tmp_path)])
    assert result.returncode != 0
    for rank in (0, 1):
        assert f"rank {rank} refused: extra_state_dict() returns 'cursor' with different " \
               "values on different ranks" in result.stdout
    assert not list((tmp_path / "ckpt/tests/run/checkpoints").glob("step_*/dream_trainer.json"))
