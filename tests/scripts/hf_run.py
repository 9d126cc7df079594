"""Script: for each layout in turn, load a tiny Llama saved by ``save_pretrained``, record
its logits, fine-tune a few steps, record them again, and export the weights from inside
the run (``export_weights`` to ROOT_DIR/live_<layout>); the final checkpoint is left for
``dream-trainer export``.

    torchrun --nproc_per_node=N hf_run.py OUT PRETRAINED_DIR ROOT_DIR LAYOUT [LAYOUT ...]
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from torch.distributed.tensor import DTensor

from dream_trainer.configs import CheckpointParameters, DeviceParameters
from dream_trainer.mixins import CheckpointConfigMixin, CheckpointMixin
from dream_trainer.parallel.dtensor import local_tensor
from tests.helpers.hf import HFConfig, HFTrainer, fixed_batch, hf_config, logits
from tests.helpers.launch import save_on_rank_zero

LAYOUTS = {"fsdp": DeviceParameters.FSDP(), "ddp": DeviceParameters.DDP(),
           "fsdp_tp": DeviceParameters(dp_shard=2, tensor_parallel=2),
           "hsdp": DeviceParameters.HSDP(dp_shard=2)}
# Per-rank batches: 4 data-parallel ranks (HSDP) read 2 each, so 32 sequences still make
# more than the 3 steps every layout takes.
BATCH = {"hsdp": 2}


class RunConfig(HFConfig, CheckpointConfigMixin):
    pass


class Run(HFTrainer, CheckpointMixin):
    """Logits and placements right after setup; logits and a live export at the end (the
    collectives these need run in hooks, while the process group exists)."""

    export_dir: Path

    def post_setup(self) -> None:
        super().post_setup()
        self.placements = {name: [str(p) for p in param.placements]
                           for name, param in self.model.named_parameters()
                           if isinstance(param, DTensor)}
        self.local_numel = sum(local_tensor(param).numel() for param in self.model.parameters())
        # After this forward FSDP2 keeps the root's own parameters gathered until the next
        # step, so the shards are counted first.
        self.initial = logits(self.model, fixed_batch())

    def post_fit(self) -> None:
        super().post_fit()
        self.final = logits(self.model, fixed_batch())
        self.exported = self.export_weights(self.export_dir)


def run(pretrained: str, root: str, layout: str) -> dict[str, Any]:
    base = hf_config(device_parameters=LAYOUTS[layout], batch=BATCH.get(layout, 4),
                     init_weights_from=Path(pretrained))
    config = RunConfig(**{**dict(base), "experiment": layout},
                       checkpoint_parameters=CheckpointParameters(root_dir=root))
    trainer = Run(config)
    trainer.export_dir = Path(root) / f"live_{layout}"
    trainer.fit()
    return {"initial": trainer.initial, "final": trainer.final,
            "placements": trainer.placements, "local_numel": trainer.local_numel,
            "global_step": trainer.global_step, "exported": trainer.exported,
            "checkpoint": trainer.checkpoint_dir / f"step_{trainer.global_step}"}


def main(out: str, pretrained: str, root: str, *layouts: str) -> None:
    results = {layout: run(pretrained, root, layout) for layout in layouts}
    save_on_rank_zero(results, out, "hf_run")


if __name__ == "__main__":
    main(*sys.argv[1:])
