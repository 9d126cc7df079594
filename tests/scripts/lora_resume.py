"""Script: a LoRA fine-tune (the peft Llama of ``lora_run``, SGD with momentum) whose base comes
from ``init_weights_from``, checkpointed every 2 steps with ``resume="latest"``: under FSDP2
on 2 ranks when launched by torchrun, in one process otherwise. Rank 0 saves every weight,
whole, right after setup (after any resume) to OUT.loaded, after step 2 to OUT.step2 and at
the end to OUT.final.

    [torchrun --nproc_per_node=2] lora_resume.py BASE ROOT OUT [--kill step:N --markers DIR]
        [--full-state] [--precompute]
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from dream_trainer.configs import CheckpointParameters, DeviceParameters, TrainingParameters
from dream_trainer.mixins import CheckpointConfigMixin, CheckpointMixin
from tests.helpers.checkpointing import Killer
from tests.helpers.hf import HFConfig, gathered_weights, hf_config
from tests.scripts.lora_run import LoraTrainer

STEPS, GLOBAL_BATCH = 4, 8


class LoraResumeConfig(HFConfig, CheckpointConfigMixin):
    out: str


class WeightSnapshots:
    """Put before a trainer: SGD with momentum over the trainable weights (its buffers must
    come back too for a run to continue exactly); rank 0 saves every weight, whole, to
    OUT.<tag> after setup (after any resume), after step 2 and at the end."""

    config: LoraResumeConfig
    model: Any
    world: Any
    global_step: int
    is_accumulating_gradients: bool

    def configure_optimizers(self) -> None:
        self.optimizer = torch.optim.SGD(
            [p for p in self.model.parameters() if p.requires_grad], lr=self.config.lr,
            momentum=0.9)

    def save(self, tag: str) -> None:
        state = {**gathered_weights(self.model), "global_step": self.global_step}
        if self.world.is_rank_zero:
            torch.save(state, f"{self.config.out}.{tag}")

    def post_setup(self) -> None:
        super().post_setup()  # type: ignore[misc]
        self.save("loaded")

    def post_train_batch(self, result: dict[str, Any], batch_idx: int) -> None:
        super().post_train_batch(result, batch_idx)  # type: ignore[misc]
        if not self.is_accumulating_gradients and self.global_step == 2:
            self.save("step2")

    def post_fit(self) -> None:
        super().post_fit()  # type: ignore[misc]
        self.save("final")


class LoraResume(WeightSnapshots, LoraTrainer, CheckpointMixin):
    pass


def config(base: Any, root: str | Path, out: str | Path, full_state: bool = False,
           ranks: int = 1) -> LoraResumeConfig:
    """``base``: ``init_weights_from``; FSDP2 over ``ranks`` (one process: a single device)."""
    params = DeviceParameters.FSDP() if ranks > 1 else DeviceParameters.SINGLE_DEVICE()
    fields = dict(hf_config(device_parameters=params, init_weights_from=base,
                            training_parameters=TrainingParameters(
                                n_epochs=1, max_steps=STEPS,
                                train_batch_size=GLOBAL_BATCH // ranks)))
    return LoraResumeConfig(**fields, out=str(out), checkpoint_parameters=CheckpointParameters(
        root_dir=root, every_n_steps=2, resume="latest", save_frozen_weights=full_state))


def main(trainer_class: type = LoraResume, sources: Any = None,
         precompute: Callable[[Any], None] | None = None) -> None:
    """Parse the command line and run ``trainer_class`` (``sources``: its
    ``init_weights_from`` given the BASE argument; the base by default; ``precompute``:
    what ``--precompute`` does to the trainer before ``fit``)."""
    parser = argparse.ArgumentParser()
    parser.add_argument("base")
    parser.add_argument("root")
    parser.add_argument("out")
    parser.add_argument("--kill", nargs="*", default=[])
    parser.add_argument("--markers", type=Path)
    parser.add_argument("--full-state", action="store_true")
    parser.add_argument("--precompute", action="store_true")
    args = parser.parse_args()
    ranks = int(os.environ.get("WORLD_SIZE", "1"))
    base = args.base if sources is None else sources(args.base)
    trainer = trainer_class(config(base, args.root, args.out, args.full_state, ranks))
    if args.precompute and precompute is not None:
        precompute(trainer)
    if args.kill:
        trainer.callbacks.append(Killer(args.kill, args.markers))
        trainer.callbacks.attach(trainer)
    trainer.fit()


if __name__ == "__main__":
    main()
