"""The logged per-step value is the whole optimizer step's: over its micro-batches and
data-parallel ranks, item-weighted with num_items; reduced only on logged steps."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

from dream_trainer.configs import DeviceParameters, LoggingParameters
from dream_trainer.mixins import JSONLoggerConfigMixin, JSONLoggerMixin
from tests.helpers.launch import REPO, check, torchrun
from tests.helpers.tokens import PaddedSequences, summed_loss, token_config, token_model
from tests.helpers.tolerance import assert_close_to_scale
from tests.helpers.toy import ToyConfig, ToyTrainer, toy_config, toy_dataset, toy_model


def one_process_token_losses(global_batch: int, steps: int) -> list[float]:
    """Each step's loss on one process: the mean over every valid token of the global batch."""
    config = token_config(DeviceParameters.SINGLE_DEVICE(), train_batch_size=global_batch)
    torch.manual_seed(config.seed)
    model = token_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=config.lr)
    losses = []
    loader = DataLoader(PaddedSequences(config.n_sequences), batch_size=global_batch)
    for inputs, targets in list(loader)[:steps]:
        loss, n = summed_loss(model, inputs, targets)
        (loss / n).backward()
        losses.append(float(loss / n))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return losses


def one_process_mean_losses(global_batch: int, steps: int) -> list[float]:
    config = toy_config(optimizer="sgd", n_samples=32)
    torch.manual_seed(config.seed)
    model = toy_model(config)
    optimizer = torch.optim.SGD(model.parameters(), lr=config.lr)
    losses = []
    for x, y in list(DataLoader(toy_dataset(32, config, seed=1), batch_size=global_batch))[:steps]:
        loss = F.mse_loss(model(x), y)
        loss.backward()
        losses.append(float(loss))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return losses


@pytest.mark.distributed
def test_logged_and_displayed_step_losses_are_the_global_batchs(tmp_path: Path) -> None:
    out = tmp_path / "result.pt"
    check(torchrun(REPO / "tests/scripts/step_loss.py", [str(out)]))
    result = torch.load(out)
    # 2 ranks x accumulation 2 x batch 2: global batches of 8.
    expected = {"weighted": one_process_token_losses(8, 6), "mean": one_process_mean_losses(8, 4)}
    for kind, losses in expected.items():
        # Summed in another order than one batch: float32 rounding only, a few ulps.
        assert_close_to_scale(result[kind]["logged"], losses, ulps=16, dtype=torch.float32,
                              msg=kind)
        # The bar prints 4 decimals (smoothing=1: each step's own value): rounding only, an
        # absolute 5e-5 whatever the CPU, beside which float32 rounding is nothing.
        torch.testing.assert_close(torch.tensor(result[kind]["printed"]),
                                   torch.tensor(losses), rtol=0, atol=5.1e-5, msg=kind)


class Counting(ToyTrainer, JSONLoggerMixin):
    reductions = 0

    def reduce_step_result(self) -> dict[str, float]:
        Counting.reductions += 1
        return super().reduce_step_result()

    def training_step(self, batch: Any, batch_idx: int) -> dict[str, Any]:
        return {**super().training_step(batch, batch_idx), "rank_note": float(batch_idx)}


class CountingConfig(ToyConfig, JSONLoggerConfigMixin):
    pass


def test_only_logged_steps_are_reduced_and_unreduced_keys_stay_local(tmp_path: Path) -> None:
    import json

    logging = LoggingParameters(log_dir=tmp_path, log_every_n_steps=3,
                                unreduced_keys=["rank_note"])
    config = CountingConfig(**dict(toy_config(n_samples=80, gradient_accumulation_steps=2)),
                            logging_parameters=logging)
    trainer = Counting(config)
    trainer.fit()
    assert trainer.global_step == 5 and Counting.reductions == 1  # step 3 only
    rows = [json.loads(line) for line in (trainer.log_dir / "metrics.jsonl").read_text()
            .splitlines() if "trainer/global_step" in line]
    assert [row["step"] for row in rows] == [3]
    assert rows[0]["rank_note"] == 5.0  # the step's last micro-batch, not the mean 4.5
    assert trainer.reduced_step_result is not None and trainer.reduced_step_result[0] == 3
