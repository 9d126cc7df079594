"""Script: a next-token model reading a ShardedStream (a ``datasets`` source from local files)
through StatefulDataLoader workers; several runs, one after the other, in one launch. Every
rank logs the samples of each step it trains; rank 0 saves the final weights. Each run resumes
from its newest checkpoint.

A run is ``NAME:BATCH:FLAGS``: the per-rank micro-batch, and flags ``s`` (shuffle), ``p``
(pack into sequences), ``g`` (SGD; else AdamW), ``k`` (die after ``--kill-step``: by an
exception on every rank, or by SIGKILL of rank 0 for the launch's last run). Run NAME lives
in ROOT/NAME and logs to LOG_DIR/NAME.

Usage: sharded_stream_run.py ROOT LOG_DIR --data DIR --workers W --max-steps N
       --run NAME:BATCH:FLAGS [--run ...] [--kill-step N --markers DIR]
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
from dream_trainer.data.documents import IGNORE
from dream_trainer.mixins import (CheckpointConfigMixin, CheckpointMixin, SetupConfigMixin,
                                  SetupMixin)
from tests.helpers.checkpointing import Killer
from tests.helpers.sharded import SEQUENCE, VOCAB

CHECKPOINT_EVERY = 3


class Config(BaseTrainerConfig, SetupConfigMixin, CheckpointConfigMixin):
    data: str
    workers: int
    batch: int
    flags: str
    log_dir: str


def fixed_length(item: dict[str, Any]) -> torch.Tensor:
    """An unpacked item as SEQUENCE tokens (cut or padded with 0), so items batch."""
    ids = list(item["input_ids"])[:SEQUENCE]
    return torch.tensor(ids + [0] * (SEQUENCE - len(ids)), dtype=torch.long)


class StreamTrainer(BaseTrainer, SetupMixin, CheckpointMixin):
    config: Config

    def configure_models(self) -> None:
        self.model = nn.Sequential(nn.Embedding(VOCAB, 8), nn.Linear(8, VOCAB))

    def configure_optimizers(self) -> None:
        parameters = self.model.parameters()
        self.optimizer = torch.optim.SGD(parameters, lr=0.5) if "g" in self.config.flags \
            else torch.optim.AdamW(parameters, lr=1e-2)

    def configure_dataloaders(self) -> tuple[Any, None]:
        import datasets
        from torchdata.stateful_dataloader import StatefulDataLoader

        # No progress bar, so no tqdm monitor thread: forking the loader's workers while
        # another thread runs can deadlock the child in CPython 3.11 (seen here, once).
        datasets.disable_progress_bars()
        source = datasets.load_from_disk(self.config.data)
        packed = "p" in self.config.flags
        # "d": packed as documents, trained on each document's second half (as SFT trains
        # the answers), with the documents' attention context around the step.
        documents = {"documents": True, "labels": second_half} if "d" in self.config.flags \
            else {}
        stream = ShardedStream(source, seed=5, shuffle="s" in self.config.flags,
                               sequence_length=SEQUENCE if packed else None,
                               transform=None if packed else fixed_length, **documents)
        return StatefulDataLoader(stream, batch_size=self.config.batch,
                                  num_workers=self.config.workers), None

    def training_step(self, batch: Any, batch_idx: int) -> dict[str, Any]:
        with open(Path(self.config.log_dir) / f"rank{self.world.rank}.jsonl", "a") as log:
            samples = [batch[key].tolist() for key in DOCUMENT_KEYS] \
                if isinstance(batch, dict) else batch.tolist()
            log.write(json.dumps({"step": self.global_step, "samples": samples}) + "\n")
        if isinstance(batch, dict):
            return self.documents_step(batch)
        tokens = batch % VOCAB
        logits = self.model(tokens[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))
        self.backward(loss)
        self.step(self.model, self.optimizer)
        return {"loss": loss}

    def documents_step(self, batch: dict[str, torch.Tensor]) -> dict[str, Any]:
        targets = batch["targets"].where(batch["targets"] == IGNORE, batch["targets"] % VOCAB)
        with self.documents(batch["document_ids"], batch["position_ids"]):
            logits = self.model(batch["input_ids"] % VOCAB)
            loss = F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1),
                                   ignore_index=IGNORE, reduction="sum")
            self.backward(loss, num_items=int((targets != IGNORE).sum()))
        self.step(self.model, self.optimizer)
        return {"loss": loss}

    def validation_step(self, batch: Any, batch_idx: int) -> dict[str, Any]:
        return {}


def second_half(item: dict[str, Any]) -> list[int]:
    ids = list(item["input_ids"])
    return [IGNORE] * (len(ids) // 2) + ids[len(ids) // 2:]


DOCUMENT_KEYS = ("input_ids", "position_ids", "document_ids", "targets")


class Crash(Exception):
    """The stand-in for a kill, raised on every rank after the same step."""


class Crasher(Callback):
    def __init__(self, step: int) -> None:
        self.step = step

    def post_train_batch(self, result: dict[str, Any], batch_idx: int) -> None:
        if self.trainer.global_step == self.step:
            raise Crash


def run(args: argparse.Namespace, spec: str, last: bool) -> None:
    name, batch, flags = spec.split(":")
    log_dir = args.log_dir / name
    log_dir.mkdir(parents=True, exist_ok=True)
    trainer = StreamTrainer(Config(
        project="sharded", group="tests", experiment="run",
        device_parameters=DeviceParameters(),
        training_parameters=TrainingParameters(n_epochs=None, max_steps=args.max_steps,
                                               train_batch_size=int(batch)),
        checkpoint_parameters=CheckpointParameters(root_dir=args.root / name,
                                                   every_n_steps=CHECKPOINT_EVERY,
                                                   every_n_epochs=None, resume="latest"),
        data=args.data, workers=args.workers, batch=int(batch), flags=flags,
        log_dir=str(log_dir)))
    if "k" in flags:
        killer: Callback = Killer([f"step:{args.kill_step}"], args.markers) if last \
            else Crasher(args.kill_step)
        trainer.callbacks.append(killer)
        trainer.callbacks.attach(trainer)
    try:
        trainer.fit()
    except Crash:
        return
    if trainer.world.rank == 0:
        torch.save({"global_step": trainer.global_step,
                    "weights": {k: v.detach().clone() for k, v in trainer.model.state_dict()
                                .items()}}, log_dir / "final.pt")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("root", type=Path)
    parser.add_argument("log_dir", type=Path)
    parser.add_argument("--data", required=True)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--max-steps", type=int, required=True)
    parser.add_argument("--run", action="append", required=True)
    parser.add_argument("--kill-step", type=int)
    parser.add_argument("--markers", type=Path)
    args = parser.parse_args()
    for index, spec in enumerate(args.run):
        run(args, spec, last=index == len(args.run) - 1)


if __name__ == "__main__":
    main()
