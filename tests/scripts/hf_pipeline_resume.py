"""Script: fine-tune the tiny tied-embedding Llama (``init_weights_from``) on an endless,
stateful token stream read through torchdata's ``StatefulDataLoader``, with a token-weighted
loss (``forward_backward(..., num_items=n)``: the sequences are padded, so micro-batches hold
different numbers of valid tokens) and SGD with momentum; checkpoint every 3 optimizer steps
and resume from the latest. Under torchrun (2 ranks) the model runs as a 2-stage 1F1B pipeline;
as one plain process, without one. Optionally SIGKILL rank 0 after a given step. Each rank
saves what it holds at the end (every parameter under each of its names, tied copies
included, the optimizer state by parameter name, and the stream positions it trained on) to
OUT.rank<R>.

8 optimizer steps (``n_epochs=None``, ``max_steps=8``) of 2 accumulated micro-batches of 4.

    python hf_pipeline_resume.py PRETRAINED ROOT_DIR OUT
    torchrun --nproc_per_node=2 hf_pipeline_resume.py PRETRAINED ROOT_DIR OUT
        [--kill step:N --markers DIR]
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils.data import IterableDataset

from dream_trainer.configs import CheckpointParameters, DeviceParameters, TrainingParameters
from dream_trainer.mixins import CheckpointMixin
from tests.helpers.checkpointing import Killer
from tests.helpers.hf import SEQ, VOCAB, hf_config
from tests.helpers.streaming import RecordsTrainedOn
from tests.scripts.hf_pipeline_run import Run, RunConfig

IGNORE = -100


class TokenStream(IterableDataset[tuple[torch.Tensor, torch.Tensor, int]]):
    """Sequence ``i`` of an endless stream: random tokens, its last ``i % 5`` positions padding
    (label ``IGNORE``). The state is the next position."""

    def __init__(self) -> None:
        self.position = 0

    def __iter__(self) -> Any:
        while True:
            index = self.position
            self.position += 1
            generator = torch.Generator().manual_seed(index)
            tokens = torch.randint(0, VOCAB, (SEQ,), generator=generator)
            labels = tokens.clone()
            labels[SEQ - index % 5:] = IGNORE
            yield tokens, labels, index

    def state_dict(self) -> dict[str, int]:
        return {"position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.position = state["position"]


def summed_loss(output: Any, labels: torch.Tensor) -> torch.Tensor:
    """The next-token cross-entropy summed over the valid tokens."""
    logits = getattr(output, "logits", output)
    return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(),
                           ignore_index=IGNORE, reduction="sum")


class Streamed(RecordsTrainedOn, Run, CheckpointMixin):
    def configure_optimizers(self) -> None:
        # Momentum makes the optimizer state part of what must come back exactly.
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.05, momentum=0.9)

    def configure_dataloaders(self) -> tuple[Any, None]:
        from torchdata.stateful_dataloader import StatefulDataLoader

        return StatefulDataLoader(TokenStream(), batch_size=4), None

    def training_step(self, batch: Any, batch_idx: int) -> dict[str, Any]:
        tokens, labels, ids = batch
        self.trained_on.extend(ids.tolist())
        n = (labels[:, 1:] != IGNORE).sum()
        loss = self.forward_backward(self.model, tokens, target=labels, loss_fn=summed_loss,
                                     num_items=n)
        if not self.is_accumulating_gradients:
            return {"loss": loss / n, "grad_norm": self.step(self.model, self.optimizer)}
        return {"loss": loss / n}


def held(trainer: Streamed) -> dict[str, Any]:
    """This rank's parameters under every name (a tied weight's stage copies too), its
    optimizer state by parameter name, and the stream positions it trained on."""
    named = dict(trainer.model.named_parameters(remove_duplicate=False))
    names = {id(param): name for name, param in named.items()}
    state = trainer.optimizer.state_dict()["state"]
    params = [param for group in trainer.optimizer.param_groups for param in group["params"]]
    return {"weights": {name: param.detach().clone() for name, param in named.items()},
            "optimizer": {names[id(params[index])]: {k: v.clone() for k, v in entry.items()}
                          for index, entry in state.items()},
            "global_step": trainer.global_step, "trained_on": trainer.trained_on,
            "model_type": type(trainer.model).__name__}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("pretrained", type=Path)
    parser.add_argument("root", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--kill", nargs="*", default=[])
    parser.add_argument("--markers", type=Path)
    args = parser.parse_args()
    params = DeviceParameters(dp_replicate=1, pipeline_parallel=2, pipeline_schedule="1F1B") \
        if "RANK" in os.environ else DeviceParameters.SINGLE_DEVICE()
    training = TrainingParameters(n_epochs=None, max_steps=8, train_batch_size=4,
                                  gradient_accumulation_steps=2)
    base = hf_config("llama_tied", layers=4, training_parameters=training,
                     init_weights_from=args.pretrained, device_parameters=params)
    config = RunConfig(**dict(base), checkpoint_parameters=CheckpointParameters(
        root_dir=args.root, every_n_steps=3, every_n_epochs=None, resume="latest"))
    trainer = Streamed(config)
    if args.kill:
        trainer.callbacks.append(Killer(args.kill, args.markers))
        trainer.callbacks.attach(trainer)
    trainer.fit()
    torch.save(held(trainer), f"{args.out}.rank{trainer.world.rank}")


if __name__ == "__main__":
    main()
