"""Script: train the checkpointed toy under torchrun until killed, or to ``--max-steps``.

Usage: launcher_kill_run.py ROOT PIDS [--max-steps N]

Each rank writes its process id to ``PIDS/rank_<r>`` once set up, then trains with a
checkpoint every 2 optimizer steps (a short pause per step keeps a 2-core machine usable)
until ``--max-steps`` (default: practically forever, for a run that is to be killed). It logs
dream_trainer's INFO lines to stderr on rank 0.
"""

from __future__ import annotations

import argparse
import logging
import os
import time
from pathlib import Path
from typing import Any

from dream_trainer.callbacks import Callback
from dream_trainer.configs import CheckpointParameters, TrainingParameters
from tests.helpers.checkpointing import CheckpointedTrainer, checkpointed_config


class PidFile(Callback):
    """Writes this rank's pid once set up; sleeps a little after every optimizer step."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory

    def post_setup(self) -> None:
        staged = self.directory / f".rank_{self.trainer.world.rank}"
        staged.write_text(str(os.getpid()))
        staged.rename(self.directory / f"rank_{self.trainer.world.rank}")

    def post_train_batch(self, result: dict[str, Any], batch_idx: int) -> None:
        if not self.trainer.is_accumulating_gradients:
            time.sleep(0.02)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("root", type=Path)
    parser.add_argument("pids", type=Path)
    parser.add_argument("--max-steps", type=int, default=1_000_000)
    args = parser.parse_args()
    if os.environ.get("RANK", "0") == "0":
        logging.basicConfig(level=logging.INFO, format="%(name)s %(levelname)s %(message)s")
    config = checkpointed_config(args.root).model_copy(update={
        "training_parameters": TrainingParameters(n_epochs=None, max_steps=args.max_steps,
                                                  train_batch_size=4,
                                                  gradient_accumulation_steps=2),
        "checkpoint_parameters": CheckpointParameters(root_dir=args.root, every_n_steps=2,
                                                      every_n_epochs=None, resume="latest"),
    })
    trainer = CheckpointedTrainer(config)
    trainer.callbacks.append(PidFile(args.pids))
    trainer.callbacks.attach(trainer)
    trainer.fit()
    print(f"rank={trainer.world.rank} finished at step {trainer.global_step}", flush=True)


if __name__ == "__main__":
    main()
