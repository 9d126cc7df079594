"""Script: a next-token model reading a packed ShardedStream through StatefulDataLoader
workers; every rank logs the tokens of each step it trains and, at the end, its share of the
stream's position. Resumes from the latest checkpoint.

One launch runs a run per source (a list of documents, a ``datasets`` source), one after the
other, each in ROOT/<source> logging to LOG_DIR/<source>. With ``--kill step:N`` each run dies
after step N: every run but the last by an exception on every rank (so the next can start),
the last by SIGKILL of rank 0.

Usage: sharded_stream_run.py ROOT LOG_DIR --sources list,datasets [--data DIR] --workers W
       --max-steps N [--kill step:N --markers DIR]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from dream_trainer import BaseTrainer, BaseTrainerConfig
from dream_trainer.callbacks import Callback
from dream_trainer.configs import CheckpointParameters, DeviceParameters, TrainingParameters
from dream_trainer.data import ShardedStream
from dream_trainer.mixins import (CheckpointConfigMixin, CheckpointMixin, SetupConfigMixin,
                                  SetupMixin)
from tests.helpers.checkpointing import Killer
from tests.helpers.sharded import BATCH, SEQUENCE, VOCAB, documents


class Config(BaseTrainerConfig, SetupConfigMixin, CheckpointConfigMixin):
    source: str = "list"
    data: str | None = None
    workers: int = 2
    log_dir: str = ""


class PackedTrainer(BaseTrainer, SetupMixin, CheckpointMixin):
    config: Config

    def configure_models(self) -> None:
        self.model = nn.Sequential(nn.Embedding(VOCAB, 8), nn.Linear(8, VOCAB))

    def configure_optimizers(self) -> None:
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-2)

    def configure_dataloaders(self) -> tuple[Any, None]:
        from torchdata.stateful_dataloader import StatefulDataLoader

        if self.config.source == "datasets":
            import datasets

            source: Any = datasets.load_from_disk(self.config.data)
        else:
            source = documents()
        stream = ShardedStream(source, seed=5, sequence_length=SEQUENCE)
        return StatefulDataLoader(stream, batch_size=BATCH,
                                  num_workers=self.config.workers), None

    def training_step(self, batch: Any, batch_idx: int) -> dict[str, Any]:
        with open(Path(self.config.log_dir) / f"rank{self.world.rank}.jsonl", "a") as log:
            log.write(json.dumps({"step": self.global_step, "tokens": batch.tolist()}) + "\n")
        tokens = batch % VOCAB
        logits = self.model(tokens[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))
        self.backward(loss)
        self.step(self.model, self.optimizer)
        return {"loss": loss}

    def validation_step(self, batch: Any, batch_idx: int) -> dict[str, Any]:
        return {}


class Crash(Exception):
    """The stand-in for a kill, raised on every rank after the same step."""


class Crasher(Callback):
    def __init__(self, step: int) -> None:
        self.step = step

    def post_train_batch(self, result: dict[str, Any], batch_idx: int) -> None:
        if self.trainer.global_step == self.step:
            raise Crash


def run(args: argparse.Namespace, source: str, last: bool) -> None:
    log_dir = args.log_dir / source
    log_dir.mkdir(parents=True, exist_ok=True)
    trainer = PackedTrainer(Config(
        project="sharded", group="tests", experiment="run",
        device_parameters=DeviceParameters(),
        training_parameters=TrainingParameters(n_epochs=None, max_steps=args.max_steps,
                                               train_batch_size=BATCH),
        checkpoint_parameters=CheckpointParameters(root_dir=args.root / source,
                                                   every_n_steps=4, every_n_epochs=None,
                                                   resume="latest"),
        source=source, data=args.data, workers=args.workers, log_dir=str(log_dir)))
    if args.kill:
        killer: Callback = Killer([args.kill], args.markers) if last \
            else Crasher(int(args.kill.removeprefix("step:")))
        trainer.callbacks.append(killer)
        trainer.callbacks.attach(trainer)
    try:
        trainer.fit()
    except Crash:
        return
    piece = trainer.data_state_dict()
    (log_dir / f"piece{trainer.world.rank}.json").write_text(json.dumps(piece))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("root", type=Path)
    parser.add_argument("log_dir", type=Path)
    parser.add_argument("--sources", default="list")
    parser.add_argument("--data")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--max-steps", type=int, required=True)
    parser.add_argument("--kill")
    parser.add_argument("--markers", type=Path)
    args = parser.parse_args()
    sources = args.sources.split(",")
    for index, source in enumerate(sources):
        run(args, source, last=index == len(sources) - 1)


if __name__ == "__main__":
    main()
