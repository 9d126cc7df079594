"""Script: a model whose state-dict hook renames keys (a fused q/k/v weight saved as three),
under FSDP2 on 2 ranks: resume bit for bit, ``init_weights_from`` a checkpoint and an export
(hooks saving views and saving copies), the fused weights blocks of their own.

Usage: renamed_keys_run.py ROOT  (prints "renamed keys ok" on each rank)
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch
from torch.distributed.fsdp import FSDPModule

from dream_trainer.configs import DeviceParameters
from dream_trainer.parallel.dtensor import is_dtensor
from tests.helpers.fused_qkv import FusedTrainer, config

FSDP = DeviceParameters.FSDP()


def full(trainer: FusedTrainer) -> dict[str, torch.Tensor]:
    return {name: (param.full_tensor() if is_dtensor(param) else param).detach().clone()
            for name, param in trainer.model.named_parameters()}


class Recording(FusedTrainer):
    """Keeps its trained weights, gathered whole, before the group is gone."""

    def post_fit(self) -> None:
        super().post_fit()
        self.trained = full(self)


def started(root: Path, **update: Any) -> tuple[FusedTrainer, dict[str, torch.Tensor]]:
    """Set up a trainer (not fitted), read its gathered weights, shut it down."""
    copies = update.pop("copies", False)
    trainer = FusedTrainer(config(root, 2, copies=copies, device_parameters=FSDP).model_copy(
        update=update))
    try:
        trainer.set_up()
        return trainer, full(trainer)
    finally:
        trainer.teardown()
        trainer.world.shutdown()


def equal(mine: dict[str, torch.Tensor], theirs: dict[str, torch.Tensor], what: str) -> None:
    assert mine.keys() == theirs.keys(), what
    for name in mine:
        assert torch.equal(mine[name], theirs[name]), (what, name)


def main() -> None:
    root = Path(sys.argv[1])
    whole = Recording(config(root / "whole", 4, device_parameters=FSDP))
    whole.fit()
    first = Recording(config(root / "resumed", 2, device_parameters=FSDP))
    first.fit()
    # Each fused layer is a block of its own (a ModuleDict holds them), as is the root.
    assert isinstance(first.model.layers["0"], FSDPModule) and isinstance(first.model, FSDPModule)
    checkpoint = first.checkpoint_dir / "step_2"
    resumed = Recording(config(root / "resumed", 4, resume=checkpoint, device_parameters=FSDP))
    resumed.fit()
    equal(resumed.trained, whole.trained, "resume")
    assert not torch.equal(first.trained["head.weight"], whole.trained["head.weight"])

    exporter = FusedTrainer(config(root / "export", 2, resume=checkpoint, device_parameters=FSDP))
    try:
        exporter.set_up()
        export = Path(exporter.export_weights(root / "exported")["model"])
    finally:
        exporter.teardown()
        exporter.world.shutdown()
    for source in (checkpoint, export):
        for copies in (False, True):
            _, weights = started(root / f"start-{source.name}-{copies}", copies=copies,
                                 init_weights_from=source)
            equal(weights, first.trained, f"init_weights_from {source.name} copies={copies}")
    print("renamed keys ok")


if __name__ == "__main__":
    main()
