"""BaseTrainer against hand-written PyTorch: identical weights, bit for bit."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.helpers.launch import REPO, check, torchrun
from tests.helpers.toy import ToyTrainer, hand_written_loop, toy_config


def test_single_process_parity_is_bit_exact() -> None:
    config = toy_config(n_samples=160, train_batch_size=8)
    trainer = ToyTrainer(config)
    trainer.fit()
    assert trainer.global_step == 20
    reference = hand_written_loop(config, steps=20)
    ours = trainer.model.state_dict()
    for name, tensor in reference.state_dict().items():
        assert torch.equal(ours[name], tensor), name
    # The trained weights moved away from the initialization (the comparison is not vacuous).
    untrained = hand_written_loop(config, steps=0)
    assert not torch.equal(untrained.state_dict()["0.weight"], ours["0.weight"])


@pytest.mark.distributed
def test_two_rank_ddp_parity_is_bit_exact(tmp_path: Path) -> None:
    out = tmp_path / "result.pt"
    check(torchrun(REPO / "tests/scripts/ddp_parity.py", [str(out)]))
    result = torch.load(out)
    assert result["global_step"] == 10  # 160 samples / 2 ranks / batch 8
    for name, tensor in result["reference"].items():
        assert torch.equal(result["trainer"][name], tensor), name
    # After fit the DDP wrapper is released (it would outlive the process group).
    assert result["unwrapped_after_fit"]
    # Both ranks hold the same weights, and the validation mean covers both ranks' halves.
    for name, tensor in result["trainer"].items():
        assert torch.equal(result["rank1_trainer"][name], tensor), name
    assert result["val_loss_rank0"] == result["val_loss_rank1"]
    assert result["val_loss_rank0"] == pytest.approx(result["val_loss_full"], rel=1e-6)
