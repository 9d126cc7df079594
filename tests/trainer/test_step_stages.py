"""The optimizer step's declared points and its one update vote, in one process (the same
stages under FSDP2 and a pipeline: tests/parallel/test_pipeline_parallel.py)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import torch

from dream_trainer.callbacks import NanGuard
from dream_trainer.trainer.step_stages import STAGES, StepPoints, UpdateVote
from tests.helpers.checkpointing import CheckpointedTrainer, checkpointed_config
from tests.helpers.toy import ToyTrainer, toy_config


class Vetoing(ToyTrainer):
    """Votes against the update of every third step, and records the weights around it."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.weights: list[torch.Tensor] = []
        self.update_vote.add("every_third", lambda model, optimizer: self.global_step % 3 != 2)
        self.step_points.add("after_update", "weights",
                             lambda model, optimizer: self.weights.append(
                                 next(model.parameters()).detach().clone()))


def test_a_voter_skips_the_update_and_the_skip_is_counted_under_its_cause(
        caplog: pytest.LogCaptureFixture) -> None:
    trainer = Vetoing(toy_config(n_samples=64))
    with caplog.at_level(logging.WARNING, logger="dream_trainer.trainer.step_stages"):
        trainer.fit()
    assert trainer.global_step == 8
    assert trainer.update_vote.skipped == {"every_third": 2}  # steps 3 and 6
    assert "optimizer step 3: the update was skipped (every_third); skipped so far: " \
           "every_third 1" in caplog.text
    changed = [not torch.equal(a, b) for a, b in zip(trainer.weights, trainer.weights[1:])]
    assert changed == [True, False, True, True, False, True, True]


def test_nan_guard_vetoes_through_the_vote_and_the_count_survives_a_resume(
        tmp_path: Path) -> None:
    class Poisoned(CheckpointedTrainer):
        def training_step(self, batch: Any, batch_idx: int) -> dict[str, Any]:
            x, y, ids = batch
            if self.global_step == 2:
                x = x * float("nan")
            return super().training_step((x, y, ids), batch_idx)

    config = checkpointed_config(tmp_path, every_n_steps=None)
    config = config.model_copy(update={"callbacks": [NanGuard(mode="skip",
                                                              output_dir=tmp_path / "nan")],
                                       "training_parameters": config.training_parameters
                                       .model_copy(update={"max_steps": 5})})
    first = Poisoned(config)
    first.fit()
    guard = next(c for c in first.callbacks if isinstance(c, NanGuard))
    assert first.update_vote.skipped == {"nan_guard": 1} and guard.skipped_steps == 1
    resumed = Poisoned(config.model_copy(update={"training_parameters": config
                                                 .training_parameters.model_copy(
                                                     update={"max_steps": 6})}))
    resumed.fit()
    assert resumed.global_step == 6 and resumed.update_vote.skipped == {"nan_guard": 1}
    assert next(c for c in resumed.callbacks if isinstance(c, NanGuard)).skipped_steps == 1


def test_points_and_voters_are_named_once_and_the_stages_are_declared() -> None:
    points, vote = StepPoints(), UpdateVote()
    points.add("after_backward", "noise", lambda model, optimizer: None)
    with pytest.raises(ValueError, match="'noise' is already registered at after_backward"):
        points.add("after_backward", "noise", lambda model, optimizer: None)
    with pytest.raises(ValueError, match="no step point 'before_clip'"):
        points.add("before_clip", "x", lambda model, optimizer: None)
    vote.add("mine", lambda model, optimizer: True)
    with pytest.raises(ValueError, match="already has a voter for 'mine'"):
        vote.add("mine", lambda model, optimizer: False)
    names = [name for name, _ in STAGES]
    assert names.index("unscale") < names.index("after_backward") < names.index("clip") \
        < names.index("vote") < names.index("apply") < names.index("after_update") \
        < names.index("zero")
    state = {"skipped": [["fault_tolerance", 2], ["nan_guard", 1]]}
    vote.load_state_dict(state)
    assert vote.state_dict() == state
