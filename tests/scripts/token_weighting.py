"""torchrun script (2 ranks): token-weighted accumulation under DDP and FSDP2 against one
process on each whole global batch; also the per-micro-batch mean loss for contrast."""

from __future__ import annotations

import sys
from typing import Any

import torch

from dream_trainer.configs import DeviceParameters
from tests.helpers.launch import save_on_rank_zero
from tests.helpers.tokens import TokenTrainer, one_process_token_mean, token_config

BATCH, ACCUMULATION, RANKS = 2, 4, 2


def full_state(trainer: TokenTrainer) -> dict[str, torch.Tensor]:
    from torch.distributed.tensor import DTensor

    model = getattr(trainer.model, "module", trainer.model)
    return {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
            for k, v in model.state_dict().items()}


class Recording(TokenTrainer):
    def post_fit(self) -> None:
        self.final = full_state(self)  # a collective under FSDP2: while the group exists


def run(device_parameters: DeviceParameters, weighted: bool = True) -> dict[str, torch.Tensor]:
    trainer = Recording(token_config(device_parameters, train_batch_size=BATCH,
                                     gradient_accumulation_steps=ACCUMULATION,
                                     weighted=weighted))
    trainer.fit()
    assert trainer.global_step == 3, trainer.global_step  # 48 sequences, 16 per step
    return trainer.final


def main(out: str) -> None:
    results: dict[str, Any] = {
        "ddp": run(DeviceParameters.DDP()),
        "fsdp": run(DeviceParameters.FSDP()),
        "ddp_mean_of_means": run(DeviceParameters.DDP(), weighted=False),
    }
    reference = one_process_token_mean(token_config(DeviceParameters.SINGLE_DEVICE(),
                                                    train_batch_size=BATCH),
                                       BATCH * ACCUMULATION * RANKS, steps=3)
    results["one_process"] = {k: v.detach().clone() for k, v in reference.state_dict().items()}
    save_on_rank_zero(results, out, "token_weighting")


if __name__ == "__main__":
    main(sys.argv[1])
