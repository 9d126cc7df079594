"""Script: train a larger toy model and SIGKILL this process DELAY seconds into the save at
step 8 (or, with DELAY < 0, let it finish). Usage: kill_during_save.py ROOT DELAY"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from pathlib import Path

from tests.helpers.checkpointing import CheckpointedTrainer, checkpointed_config


class KilledDuringSave(CheckpointedTrainer):
    def save_checkpoint(self, asynchronous: bool | None = None) -> Path:
        delay = float(sys.argv[2])
        if self.global_step == 8 and delay >= 0:
            threading.Timer(delay, os.kill, (os.getpid(), signal.SIGKILL)).start()
        start = time.perf_counter()
        path = super().save_checkpoint(asynchronous)
        print(f"saved step {self.global_step} in {time.perf_counter() - start:.4f}s", flush=True)
        return path


if __name__ == "__main__":
    config = checkpointed_config(Path(sys.argv[1]), resume=None)
    config = config.model_copy(update={
        "in_features": 512, "hidden": 2048,  # ~20 MB of weights and optimizer state
        "training_parameters": config.training_parameters.model_copy(update={"n_epochs": 1}),
    })
    KilledDuringSave(config).fit()
