"""torchrun script: what each rank reads and exchanges while an FSDP2 run resumes.

A toy of two 512 x 512 layers is trained one AdamW step under FSDP2 on 2 ranks and saved;
a second trainer in the same processes resumes it (``resume="latest"``) and trains one more
step. While DCP loads, every rank records each item its storage reader reads (the saved
chunk it comes from and that chunk's length in the file) and the tensor bytes that pass
through collectives (any ``c10d`` operation, DCP's planning included), and the files it
checksums (verifying step_1, committing step_2), then writes them to ``OUT.rank<R>`` as
JSON. Usage: resume_reads.py ROOT OUT
"""

from __future__ import annotations

import contextlib
import json
import sys
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from unittest import mock

import torch
import torch.distributed.checkpoint as dcp
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from dream_trainer.checkpoint import agreement, directory
from dream_trainer.checkpoint.trust import reader_class
from dream_trainer.configs import CheckpointParameters, DeviceParameters, TrainingParameters
from dream_trainer.mixins import CheckpointConfigMixin, CheckpointMixin
from tests.helpers.toy import ToyConfig, ToyTrainer

COLLECTIVE_NAMESPACES = {"c10d", "_c10d_functional", "_c10d_functional_autograd"}


class ReadsConfig(ToyConfig, CheckpointConfigMixin):
    pass


class ReadsTrainer(ToyTrainer, CheckpointMixin):
    config: ReadsConfig


class CollectiveBytes(TorchDispatchMode):
    """Counts the tensor bytes (inputs and outputs as passed) of every collective."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes = 0
        self.calls: Counter[str] = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func.namespace in COLLECTIVE_NAMESPACES:
            self.calls[str(func)] += 1
            self.bytes += sum(t.numel() * t.element_size() for t in tree_leaves((args, kwargs))
                              if isinstance(t, torch.Tensor))
        return func(*args, **kwargs)


@contextlib.contextmanager
def recording(record: dict[str, Any]) -> Iterator[None]:
    """Record into ``record`` the reads and collective bytes of every ``dcp.load``."""
    read_data = reader_class().read_data
    load = dcp.load

    def recorded_read_data(self: Any, plan: Any, planner: Any) -> Any:
        for item in plan.items:
            stored = self.storage_data[item.storage_index]
            record["reads"].append({
                "fqn": item.storage_index.fqn,
                "chunk": list(item.storage_index.offset or ()),
                "file": stored.relative_path, "file_bytes": stored.length,
                "lengths": list(item.lengths)})
        return read_data(self, plan, planner)

    def recorded_load(*args: Any, **kwargs: Any) -> Any:
        with CollectiveBytes() as collectives:
            result = load(*args, **kwargs)
        record["collective_bytes"] += collectives.bytes
        record["collective_calls"].update(collectives.calls)
        return result

    checksum = directory.checksum

    def recorded_checksum(file: Path) -> str:
        record["checksummed"].append(f"{file.parent.name}/{file.name}")
        return checksum(file)

    with mock.patch.object(reader_class(), "read_data", recorded_read_data), \
            mock.patch.object(dcp, "load", recorded_load), \
            mock.patch.object(directory, "checksum", recorded_checksum), \
            mock.patch.object(agreement, "checksum", recorded_checksum):
        yield


def train(root: Path, steps: int, resume: str | None) -> ReadsTrainer:
    config = ReadsConfig(
        project="reads", group="tests", experiment="run", in_features=512, hidden=512,
        out_features=512, n_samples=32, val_samples=8,
        device_parameters=DeviceParameters.FSDP(),
        training_parameters=TrainingParameters(n_epochs=1, train_batch_size=4,
                                               max_steps=steps),
        checkpoint_parameters=CheckpointParameters(root_dir=root, resume=resume))
    trainer = ReadsTrainer(config)
    trainer.fit()
    return trainer


def main(root: Path, out: str) -> None:
    train(root, steps=1, resume=None)
    record: dict[str, Any] = {"reads": [], "collective_bytes": 0,
                              "collective_calls": Counter(), "checksummed": []}
    with recording(record):
        trainer = train(root, steps=2, resume="latest")
    assert trainer.global_step == 2
    Path(f"{out}.rank{trainer.world.rank}").write_text(json.dumps(record))


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2])
