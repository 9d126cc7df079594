"""Script: train the checkpointed toy through the step API (resume="latest"), with or without
a 2-stage pipeline, with EMA and NanGuard, optionally SIGKILLing itself. Each rank saves its
final state to OUT.rank<R>.

The toy is ``nn.Sequential(Linear, Tanh, Dropout, Linear)``: the default split gives the
first stage the first Linear with the activation and dropout after it, the second the last.

With ``--snapshot FILE`` each rank also writes what it holds (weights, optimizer state and
learning rate, by parameter name) after optimizer step ``--snapshot-step`` to
``FILE.step<N>.rank<R>``, and, when it resumed, right after loading to ``FILE.resumed.rank<R>``.

Usage: pipeline_checkpoint.py ROOT OUT [--pp N] [--kill POINT ...] [--markers DIR]
       [--samples FILE] [--snapshot FILE --snapshot-step N]
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from dream_trainer.callbacks import EMA, Callback, NanGuard
from dream_trainer.configs import DeviceParameters
from tests.helpers.checkpointing import (CheckpointedTrainer, Killer, SampleLog,
                                         checkpointed_config, final_state)


class PipelineCheckpointedTrainer(CheckpointedTrainer):
    """The same training and validation steps with and without a pipeline."""

    def training_step(self, batch: Any, batch_idx: int) -> dict[str, Any]:
        x, y, ids = batch
        self.seen_ids = ids.tolist()
        loss = self.forward_backward(self.model, x, target=y, loss_fn=F.mse_loss)
        if not self.is_accumulating_gradients:
            return {"loss": loss, "grad_norm": self.step(self.model, self.optimizer)}
        return {"loss": loss}

    def validation_step(self, batch: Any, batch_idx: int) -> dict[str, Any]:
        x, y = batch
        return {"val_loss": self.forward_loss(self.model, x, target=y, loss_fn=F.mse_loss)}


class Snapshot(Callback):
    """Writes this rank's weights and optimizer state by parameter name (see the usage)."""

    def __init__(self, path: Path, step: int) -> None:
        self.path, self.step = path, step

    def _write(self, tag: str) -> None:
        trainer = self.trainer
        names = {id(param): name for name, param in trainer.model.named_parameters()}
        optimizer = trainer.optimizer
        state = {
            "weights": {name: param.detach().clone()
                        for name, param in trainer.model.named_parameters()},
            "optimizer": {names[id(param)]: {key: value.clone() for key, value in
                                             optimizer.state[param].items()}
                          for group in optimizer.param_groups for param in group["params"]},
            "lr": [group["lr"] for group in optimizer.param_groups],
        }
        torch.save(state, f"{self.path}.{tag}.rank{trainer.world.rank}")

    def post_setup(self) -> None:
        if self.trainer.global_step > 0:
            self._write("resumed")

    def post_train_batch(self, result: dict[str, Any], batch_idx: int) -> None:
        if not self.trainer.is_accumulating_gradients and self.trainer.global_step == self.step:
            self._write(f"step{self.step}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("root", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--kill", nargs="*", default=[])
    parser.add_argument("--markers", type=Path)
    parser.add_argument("--samples", type=Path)
    parser.add_argument("--snapshot", type=Path)
    parser.add_argument("--snapshot-step", type=int, default=0)
    args = parser.parse_args()
    params = DeviceParameters(dp_replicate=1, pipeline_parallel=args.pp)
    # Resumed across layouts: the toy's per-rank state (which goes back to the same number
    # of processes only) stays off.
    config = checkpointed_config(args.root, params).model_copy(update={"rank_state": False})
    config = config.model_copy(update={"training_parameters": config.training_parameters
                                       .model_copy(update={"n_epochs": 2})})
    trainer = PipelineCheckpointedTrainer(config)
    ema = EMA(decay=0.9)
    trainer.callbacks.append(ema)
    trainer.callbacks.append(NanGuard())
    if args.kill:
        trainer.callbacks.append(Killer(args.kill, args.markers))
    if args.samples:
        trainer.callbacks.append(SampleLog(args.samples))
    if args.snapshot:
        trainer.callbacks.append(Snapshot(args.snapshot, args.snapshot_step))
    trainer.callbacks.attach(trainer)
    trainer.fit()
    state = final_state(trainer)
    state["ema"] = {key: value.clone() for key, value in ema.state_dict().items()
                    if isinstance(value, torch.Tensor)}
    torch.save(state, f"{args.out}.rank{trainer.world.rank}")


if __name__ == "__main__":
    main()
