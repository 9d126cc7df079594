"""Script: examples/word_lm.py shortened, resuming from its latest checkpoint, optionally
SIGKILLing itself after an optimizer step; rank 0 saves the final weights, optimizer state
and every rank's carried hidden state.

Usage: word_lm_run.py ROOT OUT [--kill step:N] [--markers DIR]
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path
from typing import Any

import torch

from tests.helpers.checkpointing import Killer, from_every_rank
from tests.helpers.launch import REPO

SHORT = ["--files", "[a-b]*.py", "--vocab_size", "500", "--bptt", "10", "--dim", "32",
         "--training_parameters.n_epochs", "2",
         "--training_parameters.train_steps_per_epoch", "10",
         "--training_parameters.train_batch_size", "4", "--training_parameters.val_batch_size", "4",
         "--training_parameters.val_steps_per_epoch", "2",
         "--checkpoint_parameters.every_n_steps", "4",
         "--checkpoint_parameters.resume", "latest"]


def load_example() -> Any:
    spec = importlib.util.spec_from_file_location("word_lm", REPO / "examples/word_lm.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["word_lm"] = module  # pydantic resolves the config's annotations there
    spec.loader.exec_module(module)
    return module


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("root", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--kill", nargs="*", default=[])
    parser.add_argument("--markers", type=Path)
    args = parser.parse_args()
    example = load_example()

    class Recording(example.WordLMTrainer):  # type: ignore[misc,name-defined]
        def post_fit(self) -> None:
            super().post_fit()
            self.all_hidden = from_every_rank(self.world.world_size, self.hidden)

    config = example.apply_cli_overrides(
        example.default_config(),
        [*SHORT, "--checkpoint_parameters.root_dir", str(args.root / "ckpt"),
         "--logging_parameters.log_dir", str(args.root / "logs")])
    trainer = Recording(config)
    if args.kill:
        trainer.callbacks.append(Killer(args.kill, args.markers))
        trainer.callbacks.attach(trainer)
    trainer.fit()
    if trainer.world.rank == 0:
        model = getattr(trainer.model, "module", trainer.model)
        torch.save({"weights": {k: v.clone() for k, v in model.state_dict().items()},
                    "optimizer": trainer.optimizer.state_dict()["state"],
                    "hidden": trainer.all_hidden, "global_step": trainer.global_step,
                    "val_losses": trainer.val_losses}, args.out)


if __name__ == "__main__":
    main()
