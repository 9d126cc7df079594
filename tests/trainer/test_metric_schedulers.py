"""Schedulers stepped by a metric (ReduceLROnPlateau) after validation, never by step()."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.helpers.launch import REPO, check, torchrun
from tests.helpers.toy import ToyTrainer, toy_config


class Unmonitored(ToyTrainer):
    def configure_schedulers(self) -> None:
        self.plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(self.optimizer)


def test_a_metric_scheduler_without_scheduler_monitor_is_refused_at_setup() -> None:
    with pytest.raises(ValueError, match="plateau steps on a metric .* set scheduler_monitor"):
        Unmonitored(toy_config()).fit()


@pytest.mark.distributed
def test_plateau_cuts_the_rate_exactly_on_the_plateau_on_two_ranks_and_resumes(
        tmp_path: Path) -> None:
    out = tmp_path / "lrs.pt"
    check(torchrun(REPO / "tests/scripts/plateau_run.py", [str(tmp_path), str(out)]))
    result = torch.load(out)
    lr = 1e-2
    # Values 1.0, 0.8, 0.8, 0.8, 0.7, 0.7, 0.7 with patience 1: a cut after the second epoch
    # without improvement (epochs 3 and 6).
    assert result["uninterrupted"] == [lr, lr, lr, lr / 2, lr / 2, lr / 2, lr / 4]
    # Stopped after 3 epochs and resumed: the scheduler's best and bad-epoch count came back,
    # so the cut still falls at epoch 3.
    assert result["first"] + result["resumed"] == result["uninterrupted"]
