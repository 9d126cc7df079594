"""torchrun script (2 ranks): the MoE regression under DDP with 2 accumulated micro-batches and
under FSDP2, each on the same global batch of 8 samples per step as one process; rank 0 saves
the final full weights and balancing bias of each."""

from __future__ import annotations

import sys
from typing import Any

from dream_trainer.configs import DeviceParameters
from tests.helpers.launch import save_on_rank_zero
from tests.helpers.moe import MoETrainer, moe_config
from tests.scripts.pipeline_runs import gathered


class Recording(MoETrainer):
    def post_fit(self) -> None:
        super().post_fit()
        model = getattr(self.model, "module", self.model)
        self.final = gathered(dict(model.named_parameters()))  # collective under FSDP2
        self.final["moe.expert_bias"] = self.moe().expert_bias.clone()


def run(params: DeviceParameters, batch: int, accumulation: int) -> dict[str, Any]:
    trainer = Recording(moe_config(batch, accumulation, params))
    trainer.fit()
    return {"final": trainer.final, "loads": trainer.loads, "steps": trainer.global_step}


def main(out: str) -> None:
    save_on_rank_zero({"ddp": run(DeviceParameters.DDP(), batch=2, accumulation=2),
                       "fsdp": run(DeviceParameters.FSDP(), batch=4, accumulation=1)},
                      out, "moe_ranks")


if __name__ == "__main__":
    main(sys.argv[1])
