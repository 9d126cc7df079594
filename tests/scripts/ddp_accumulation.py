"""torchrun script: DDP with accumulation 4 vs micro-batches 4x larger; counts all-reduces."""

from __future__ import annotations

import sys
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from tests.helpers.launch import init_results_group
from tests.helpers.toy import ToyTrainer, toy_config


class CountingTrainer(ToyTrainer):
    """Counts gradient all-reduces with a DDP communication hook."""

    allreduces = 0

    def apply_replicate(self, mesh: DeviceMesh) -> None:
        super().apply_replicate(mesh)

        # No annotations: DDP inspects them, and postponed (string) ones fail its check.
        def counting_allreduce(state, bucket):  # type: ignore[no-untyped-def]
            type(self).allreduces += 1
            tensor = bucket.buffer().div_(mesh.size())
            return dist.all_reduce(tensor, group=mesh.get_group(), async_op=True) \
                .get_future().then(lambda fut: fut.value()[0])

        self.model.register_comm_hook(None, counting_allreduce)


def run(**training: Any) -> tuple[dict[str, torch.Tensor], int, int]:
    CountingTrainer.allreduces = 0
    trainer = CountingTrainer(toy_config(n_samples=128, optimizer="sgd", **training))
    trainer.fit()
    weights = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    return weights, CountingTrainer.allreduces, trainer.global_step


def main(out: str) -> None:
    accumulated, accumulated_count, steps = run(train_batch_size=8, gradient_accumulation_steps=4)
    _, unaccumulated_count, _ = run(train_batch_size=8)
    whole, _, _ = run(train_batch_size=32)
    init_results_group("results")
    counts: list[Any] = [None, None]
    dist.all_gather_object(counts, (accumulated_count, unaccumulated_count))
    if dist.get_rank() == 0:
        torch.save({"accumulated": accumulated, "whole": whole, "accumulated_steps": steps,
                    "accumulated_allreduces": [c[0] for c in counts],
                    "unaccumulated_allreduces": [c[1] for c in counts]}, out)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
