"""torchrun script: a trainer whose extra_state_dict (declared shared) differs by rank must be
refused at its first save, naming the key. Usage: shared_state_run.py ROOT"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from dream_trainer.checkpoint import CheckpointError
from tests.helpers.checkpointing import CheckpointedTrainer, checkpointed_config


class PerRankInExtra(CheckpointedTrainer):
    def extra_state_dict(self) -> dict[str, Any]:
        return {**super().extra_state_dict(), "cursor": self.world.rank}


if __name__ == "__main__":
    trainer = PerRankInExtra(checkpointed_config(Path(sys.argv[1]), resume=None))
    try:
        trainer.fit()
    except CheckpointError as error:
        print(f"rank {trainer.world.rank} refused: {error}", flush=True)
        sys.exit(3)
