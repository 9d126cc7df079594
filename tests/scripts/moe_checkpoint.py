"""Script: the MoE regression (SGD with momentum) with checkpoints every 2 optimizer steps and
``resume="latest"``: under expert parallelism on 2 ranks when launched by torchrun (ep=2, each
rank holding 2 of the 4 experts), in one process otherwise; optionally SIGKILLed after a step.
Rank 0 saves the full weights, balancing bias and step count right after setup (after any
resume) to OUT.loaded, after each step of ``--snapshot`` to OUT.step<N>, and at the end to
OUT.final.

    [torchrun --nproc_per_node=2] moe_checkpoint.py ROOT OUT [--kill step:N --markers DIR]
        [--snapshot N ...]
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

import torch

from dream_trainer.configs import CheckpointParameters, DeviceParameters
from dream_trainer.mixins import CheckpointConfigMixin, CheckpointMixin
from tests.helpers.checkpointing import Killer
from tests.helpers.moe import MoEConfig, MoETrainer, moe_config
from tests.scripts.pipeline_runs import gathered


class CheckpointedMoEConfig(MoEConfig, CheckpointConfigMixin):
    out: str
    snapshots: list[int] = []


class CheckpointedMoE(MoETrainer, CheckpointMixin):
    config: CheckpointedMoEConfig

    def configure_optimizers(self) -> None:
        # Momentum: the optimizer state must come back too for the run to continue exactly.
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.1, momentum=0.9)

    def full_state(self) -> dict[str, Any]:
        model = getattr(self.model, "module", self.model)
        state = gathered(dict(model.named_parameters()))  # a collective under FSDP2
        return {**state, "moe.expert_bias": self.moe().expert_bias.clone(),
                "global_step": self.global_step}

    def save(self, tag: str) -> None:
        state = self.full_state()  # every rank: a collective
        if self.world.is_rank_zero:
            torch.save(state, f"{self.config.out}.{tag}")

    def post_setup(self) -> None:
        super().post_setup()
        self.save("loaded")

    def post_train_batch(self, result: dict[str, Any], batch_idx: int) -> None:
        super().post_train_batch(result, batch_idx)
        if not self.is_accumulating_gradients and self.global_step in self.config.snapshots:
            self.save(f"step{self.global_step}")

    def post_fit(self) -> None:
        super().post_fit()
        self.save("final")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("root", type=Path)
    parser.add_argument("out")
    parser.add_argument("--kill", nargs="*", default=[])
    parser.add_argument("--markers", type=Path)
    parser.add_argument("--snapshot", nargs="*", type=int, default=[])
    args = parser.parse_args()
    params = DeviceParameters(expert_parallel=2) if "RANK" in os.environ \
        else DeviceParameters.SINGLE_DEVICE()
    batch = 4 if "RANK" in os.environ else 8  # 8 samples per step either way
    base = moe_config(batch, 1, params)
    config = CheckpointedMoEConfig(
        **dict(base), out=args.out, snapshots=args.snapshot,
        checkpoint_parameters=CheckpointParameters(root_dir=args.root, every_n_steps=2,
                                                   resume="latest"))
    trainer = CheckpointedMoE(config)
    if args.kill:
        trainer.callbacks.append(Killer(args.kill, args.markers))
        trainer.callbacks.attach(trainer)
    trainer.fit()


if __name__ == "__main__":
    main()
