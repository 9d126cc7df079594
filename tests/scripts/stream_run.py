"""Script: train on the logged stream (StatefulDataLoader, 2 workers), resuming from the
latest checkpoint, optionally SIGKILLing itself after a step; rank 0 saves the final weights,
optimizer state, and every rank's trained-on sample ids.

Usage: stream_run.py ROOT OUT [--kill step:N --markers DIR] [--read-log FILE]
       [--accumulation N]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from tests.helpers.checkpointing import Killer, from_every_rank
from tests.helpers.streaming import StreamTrainer, stream_config


class Recording(StreamTrainer):
    def post_fit(self) -> None:
        super().post_fit()
        self.all_trained_on = from_every_rank(self.world.world_size, self.trained_on)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("root", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--kill", nargs="*", default=[])
    parser.add_argument("--markers", type=Path)
    parser.add_argument("--read-log")
    parser.add_argument("--accumulation", type=int, default=1)
    args = parser.parse_args()
    config = stream_config(args.root)
    training = config.training_parameters.model_copy(
        update={"gradient_accumulation_steps": args.accumulation})
    config = config.model_copy(update={"read_log": args.read_log,
                                       "training_parameters": training})
    trainer = Recording(config)
    if args.kill:
        trainer.callbacks.append(Killer(args.kill, args.markers))
        trainer.callbacks.attach(trainer)
    trainer.fit()
    if trainer.world.rank == 0:
        torch.save({"weights": {k: v.clone() for k, v in trainer.model.state_dict().items()},
                    "optimizer": trainer.optimizer.state_dict()["state"],
                    "global_step": trainer.global_step,
                    "trained_on": trainer.all_trained_on}, args.out)


if __name__ == "__main__":
    main()
