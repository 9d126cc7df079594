"""Script: a checkpointing run that says when it holds its experiment's lock, then trains
slowly until killed. Usage: locking_run.py ROOT"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

from dream_trainer.callbacks import Callback
from tests.helpers.checkpointing import CheckpointedTrainer, checkpointed_config


class Slow(Callback):
    def post_setup(self) -> None:
        print("LOCKED", flush=True)

    def post_train_batch(self, result: dict[str, Any], batch_idx: int) -> None:
        time.sleep(0.5)


if __name__ == "__main__":
    config = checkpointed_config(Path(sys.argv[1]), resume=None)
    CheckpointedTrainer(config.model_copy(update={"callbacks": [Slow()]})).fit()
