"""backward(loss, num_items=n): the update is the mean over every item of the global batch."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dream_trainer.configs import DeviceParameters
from tests.helpers.launch import REPO, check, torchrun
from tests.helpers.tokens import TokenTrainer, one_process_token_mean, token_config
from tests.helpers.tolerance import assert_close_to_scale


class Mixing(TokenTrainer):
    def training_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
        from tests.helpers.tokens import summed_loss

        loss, n = summed_loss(self.model, *batch)
        if batch_idx % 2:
            self.backward(loss / n)
        else:
            self.backward(loss, num_items=n)
        return {}


def test_one_process_accumulation_equals_the_token_mean_of_the_window() -> None:
    trainer = TokenTrainer(token_config(DeviceParameters.SINGLE_DEVICE(), train_batch_size=4,
                                        gradient_accumulation_steps=4))
    trainer.fit()
    reference = one_process_token_mean(trainer.config, global_batch=16, steps=3)
    for (name, a), (_, b) in zip(trainer.model.state_dict().items(),
                                 reference.state_dict().items()):
        # Sums of a few hundred float32 terms in another order: ~1e-7 apart after 3 steps,
        # about an ulp of the weights' scale.
        assert_close_to_scale(a, b, ulps=16, msg=name)


def test_a_window_mixing_summed_and_mean_losses_is_refused() -> None:
    trainer = Mixing(token_config(DeviceParameters.SINGLE_DEVICE(), train_batch_size=4,
                                  gradient_accumulation_steps=2))
    with pytest.raises(ValueError, match="with and without num_items in one accumulation"):
        trainer.fit()


@pytest.mark.parametrize("bad", [-1, 2.5, torch.ones(2)])
def test_num_items_must_be_a_count(bad: object) -> None:
    from dream_trainer.trainer.item_weighting import ItemWeighting

    with pytest.raises(ValueError, match="num_items must be"):
        ItemWeighting(torch.device("cpu")).add(bad)  # type: ignore[arg-type]


@pytest.mark.distributed
def test_ddp_and_fsdp_accumulation_equal_one_process_on_the_global_batch(tmp_path: Path) -> None:
    out = tmp_path / "result.pt"
    check(torchrun(REPO / "tests/scripts/token_weighting.py", [str(out)]))
    result = torch.load(out)
    reference = result["one_process"]
    for mode in ("ddp", "fsdp"):
        for name, tensor in reference.items():
            # 4 micro-batches x 2 ranks summed in another order than one batch: float32
            # rounding only, ~1e-7 after 3 SGD steps.
            assert_close_to_scale(result[mode][name], tensor, ulps=16, msg=f"{mode}: {name}")
    # The mean of per-micro-batch means weighs a short sequence's tokens more: a different
    # update, by far more than the tolerance above.
    worst = max(float((result["ddp_mean_of_means"][k] - v).abs().max())
                for k, v in reference.items())
    assert worst > 1e-4, worst
