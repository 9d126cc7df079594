"""Script: the metrics trainer for 2 epochs; rank 0 saves the final metrics and weights.
Usage: eval_run.py ROOT OUT"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from dream_trainer.configs import LoggingParameters
from tests.helpers.checkpointing import checkpointed_config
from tests.helpers.metrics import MetricsConfig, MetricsTrainer


def main(root: Path, out: Path) -> None:
    base = checkpointed_config(root, resume=None)
    config = MetricsConfig(**{**dict(base), "val_samples": 32,
                              "logging_parameters": LoggingParameters(log_dir=root, log_every_n_steps=2)})
    trainer = MetricsTrainer(config)
    trainer.fit()
    if trainer.world.rank == 0:
        model = getattr(trainer.model, "module", trainer.model)
        torch.save({"metrics": trainer.final_val, "weights": model.state_dict()}, out)


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
