"""torchrun script: BaseTrainer with DDP vs a hand-written DDP loop on the same ranks."""

from __future__ import annotations

import sys
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from tests.helpers.launch import init_results_group
from tests.helpers.toy import ToyTrainer, hand_written_loop, toy_config, toy_dataset


class Recording(ToyTrainer):
    def post_val_epoch(self, result: dict[str, Any]) -> None:
        self.val_loss = result["val_loss"]


def main(out: str) -> None:
    config = toy_config(n_samples=160, train_batch_size=8, val_samples=32)
    trainer = Recording(config)
    trainer.fit()
    unwrapped = not isinstance(trainer.model, torch.nn.parallel.DistributedDataParallel)
    weights = {k: v.clone() for k, v in trainer.model.state_dict().items()}

    init_results_group("results")
    reference = hand_written_loop(config, steps=10, ddp=True)
    # What the validation mean over both ranks must equal: the mean of per-batch losses over
    # the whole validation set, evaluated with the trained weights.
    val = toy_dataset(config.val_samples, config, seed=2)
    model = trainer.model.eval()
    with torch.no_grad():
        full = [F.mse_loss(model(val.tensors[0][i:i + 8]), val.tensors[1][i:i + 8]).item()
                for i in range(0, config.val_samples, 8)]
    gathered: list[Any] = [None, None]
    dist.all_gather_object(gathered, (weights, trainer.val_loss))
    if dist.get_rank() == 0:
        torch.save({"trainer": weights, "reference": reference.state_dict(),
                    "rank1_trainer": gathered[1][0], "val_loss_rank0": gathered[0][1],
                    "val_loss_rank1": gathered[1][1], "val_loss_full": sum(full) / len(full),
                    "global_step": trainer.global_step, "unwrapped_after_fit": unwrapped}, out)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
