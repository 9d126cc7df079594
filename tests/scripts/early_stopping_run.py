"""Script: EarlyStopping under 2 ranks; rank 1 is more patient, yet stops with rank 0.

With lr=0 the validation loss repeats exactly, so only epoch 0 improves: rank 0 (patience 2)
decides to stop after epoch 2, and the agreement inside EarlyStopping stops rank 1 (patience 4)
at the same step. Each rank prints where it stopped.
"""

from __future__ import annotations

import os

from dream_trainer.callbacks.early_stopping import EarlyStopping
from tests.helpers.toy import ToyTrainer, toy_config

if __name__ == "__main__":
    rank = int(os.environ["RANK"])
    stopper = EarlyStopping("val_loss", patience=2 if rank == 0 else 4)
    trainer = ToyTrainer(toy_config(callbacks=[stopper], n_epochs=10, n_samples=160,
                                    optimizer="sgd", lr=0.0))
    trainer.fit()
    print(f"rank {trainer.world.rank} stopped at global step {trainer.global_step} "
          f"(epoch {trainer.current_epoch}, wait {stopper.wait})", flush=True)
