"""Script: the checkpointed toy with the CSV and JSONL loggers on (every step logged),
resuming the latest checkpoint, optionally SIGKILLing itself at a point (see ``Killer``).

Usage: logged_kill_run.py ROOT ATTEMPT [--kill POINT] [--markers DIR]

Each step's and validation's results carry ``attempt`` (``val_attempt``), so that the
logs show which run wrote a row.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from dream_trainer.configs import LoggingParameters
from dream_trainer.mixins import (CSVLoggerConfigMixin, CSVLoggerMixin, JSONLoggerConfigMixin,
                                  JSONLoggerMixin)
from tests.helpers.checkpointing import (CheckpointedConfig, CheckpointedTrainer, Killer,
                                         checkpointed_config)


class LoggedConfig(CheckpointedConfig, CSVLoggerConfigMixin, JSONLoggerConfigMixin):
    attempt: int = 1


class LoggedTrainer(CheckpointedTrainer, CSVLoggerMixin, JSONLoggerMixin):
    config: LoggedConfig

    def training_step(self, batch: Any, batch_idx: int) -> dict[str, Any]:
        return {**super().training_step(batch, batch_idx), "attempt": self.config.attempt}

    def validation_step(self, batch: Any, batch_idx: int) -> dict[str, Any]:
        return {**super().validation_step(batch, batch_idx),
                "val_attempt": self.config.attempt}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("root", type=Path)
    parser.add_argument("attempt", type=int)
    parser.add_argument("--kill", nargs="*", default=[])
    parser.add_argument("--markers", type=Path)
    args = parser.parse_args()
    base = checkpointed_config(args.root, every_n_steps=5)
    config = LoggedConfig(**{name: getattr(base, name) for name in type(base).model_fields},
                          attempt=args.attempt,
                          logging_parameters=LoggingParameters(log_dir=args.root / "logs",
                                                               log_every_n_steps=1))
    trainer = LoggedTrainer(config)
    if args.kill:
        trainer.callbacks.append(Killer(args.kill, args.markers))
        trainer.callbacks.attach(trainer)
    trainer.fit()
    print(f"step={trainer.global_step}")


if __name__ == "__main__":
    main()
