"""Script: packed supervised fine-tuning of a tiny transformers Llama on documents of random
lengths (``ShardedStream(documents=True)``, the loss on the second half of each document),
one run per layout in one launch; rank 0 saves each run's final weights and losses.

    torchrun --nproc_per_node=N documents_run.py OUT LAYOUT [LAYOUT ...]
"""

from __future__ import annotations

import sys
from typing import Any

import torch
from torch.utils.data import DataLoader

from dream_trainer.configs import DeviceParameters, TrainingParameters
from dream_trainer.data import ShardedStream
from dream_trainer.data.documents import IGNORE
from tests.helpers.hf import VOCAB, RecordingHFTrainer, hf_config, summed_loss
from tests.helpers.launch import save_on_rank_zero

LAYOUTS = {"single": DeviceParameters.SINGLE_DEVICE(), "ddp": DeviceParameters.DDP(),
           "fsdp": DeviceParameters.FSDP(), "tp": DeviceParameters(tensor_parallel=2,
                                                                     dp_shard=1),
           "pp": DeviceParameters(pipeline_parallel=2, dp_shard=1, pipeline_microbatches=2),
           "pp_cp": DeviceParameters(pipeline_parallel=2, context_parallel=2, dp_shard=1),
           "cp": DeviceParameters(context_parallel=2, dp_shard=1),
           "cp_fsdp": DeviceParameters(context_parallel=2, dp_shard=2)}
DATA_PARALLEL = {"ddp": 2, "fsdp": 2, "cp_fsdp": 2}
GLOBAL_BATCH, SEQUENCE, STEPS = 4, 16, 3


def documents() -> list[dict[str, list[int]]]:
    """In order, the first sample's documents end exactly at a cut of the sequence between
    context-parallel chunks (4 of 16 tokens each), then one spans the next cut; after them
    documents of random lengths."""
    generator = torch.Generator().manual_seed(7)
    lengths = [4, 6, 3] + torch.randint(2, 12, (40,), generator=generator).tolist()
    return [{"input_ids": torch.randint(0, VOCAB, (n,), generator=generator).tolist()}
            for n in lengths]


def second_half(item: dict[str, list[int]]) -> list[int]:
    """Train only each document's second half, as SFT trains the answers."""
    ids = item["input_ids"]
    return [IGNORE] * (len(ids) // 2) + ids[len(ids) // 2:]


class PackedTrainer(RecordingHFTrainer):
    def configure_dataloaders(self) -> tuple[Any, None]:
        stream = ShardedStream(documents(), shuffle=False, sequence_length=SEQUENCE,
                               documents=True, labels=second_half)
        return DataLoader(stream, batch_size=self.config.training_parameters.train_batch_size), \
            None

    def training_step(self, batch: Any, batch_idx: int) -> dict[str, Any]:
        # The whole sequences' documents around the step; forward_backward splits the
        # sequences under context parallelism and the batch into microbatches under a
        # pipeline (each stage masking the microbatch it runs).
        trained = int((batch["targets"] != IGNORE).sum())
        with self.documents(batch["document_ids"], batch["position_ids"]):
            loss = self.forward_backward(self.model, batch["input_ids"],
                                         target=batch["targets"], loss_fn=summed_loss,
                                         num_items=trained)
        self.step(self.model, self.optimizer)
        return {"loss": loss}


def run(layout: str) -> dict[str, Any]:
    params = LAYOUTS[layout]
    ranks = DATA_PARALLEL.get(layout, 1)
    config = hf_config(device_parameters=params, training_parameters=TrainingParameters(
        n_epochs=None, max_steps=STEPS, train_batch_size=GLOBAL_BATCH // ranks))
    trainer = PackedTrainer(config)
    try:
        trainer.fit()
    except ValueError as error:  # the layouts that refuse packed documents
        return {"refused": str(error)}
    return {"weights": trainer.final, "initial": trainer.initial, "steps": trainer.global_step}


def main(out: str, layouts: list[str]) -> None:
    save_on_rank_zero({layout: run(layout) for layout in layouts}, out, "documents")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
