"""Script: train the checkpointed toy with FSDP2 and checkpoints at an s3:// URL
(resume="latest"), optionally SIGKILLing itself; rank 0 saves the full final weights.

Usage: object_store_run.py URL OUT [--kill POINT ...] [--markers DIR] [--keep-top-k K]
       [--async-save]
POINT is one of Killer's (``step:N``...) or ``upload:N``: rank 0 dies once the checkpoint of
step N has its data and ``.metadata`` uploaded, before its commit marker. The endpoint and
credentials come from the environment (tests/helpers/s3.py sets them).
"""

from __future__ import annotations

import argparse
import os
import signal
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from dream_trainer.callbacks import Callback
from dream_trainer.configs import DeviceParameters
from tests.helpers.checkpointing import CheckpointedTrainer, Killer, checkpointed_config


class FinalWeights(Callback):
    """Gathers the full weights at the end of fit, while the process group is up."""

    weights: dict[str, torch.Tensor] = {}

    def post_fit(self) -> None:
        self.weights = get_model_state_dict(self.trainer.model, options=StateDictOptions(
            full_state_dict=True, cpu_offload=True))


def kill_in_upload(steps: set[int], markers: Path) -> None:
    """SIGKILL rank 0 (DCP's coordinator) once per step of ``steps``, right after DCP wrote
    that checkpoint's ``.metadata`` and before dream_trainer writes its commit marker."""
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

    finish = FsspecWriter.finish

    def finish_then_die(self: Any, metadata: Any, results: Any) -> None:
        finish(self, metadata, results)
        step = int(str(self.path).rstrip("/").rsplit("_", 1)[1])
        marker = markers / f"upload_{step}"
        if step in steps and not marker.exists():
            marker.touch()
            os.kill(os.getpid(), signal.SIGKILL)

    FsspecWriter.finish = finish_then_die  # type: ignore[method-assign]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("url")
    parser.add_argument("out", type=Path)
    parser.add_argument("--kill", nargs="*", default=[])
    parser.add_argument("--markers", type=Path)
    parser.add_argument("--keep-top-k", type=int)
    parser.add_argument("--async-save", action="store_true")
    args = parser.parse_args()
    config = checkpointed_config(args.url, DeviceParameters.FSDP(),  # type: ignore[arg-type]
                                 keep_top_k=args.keep_top_k, async_save=args.async_save)
    trainer = CheckpointedTrainer(config)
    uploads = {int(point.split(":")[1]) for point in args.kill if point.startswith("upload:")}
    if uploads:
        kill_in_upload(uploads, args.markers)
    if args.kill:
        trainer.callbacks.append(Killer(args.kill, args.markers, 0, signal.SIGKILL))
    final = FinalWeights()
    trainer.callbacks.append(final)
    trainer.callbacks.attach(trainer)
    trainer.fit()
    print(f"rank={trainer.world.rank} step={trainer.global_step} "
          f"checkpoint_dir={trainer.checkpoint_dir}")
    if trainer.world.rank == 0:
        torch.save({"weights": final.weights, "step": trainer.global_step}, args.out)


if __name__ == "__main__":
    main()
