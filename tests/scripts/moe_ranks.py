"""torchrun script: the MoE regression in several data- and expert-parallel layouts, each on
the same global batch of 8 samples per step as one process; rank 0 saves, per mode, the final
full weights and balancing bias, each rank's step loads, and the experts this rank held.

    torchrun --nproc_per_node=N moe_ranks.py OUT MODE [MODE ...]
"""

from __future__ import annotations

import io
import sys
from typing import Any

from dream_trainer.callbacks import EMA
from dream_trainer.callbacks.summaries import ModelSummary
from dream_trainer.configs import DeviceParameters
from dream_trainer.parallel.dtensor import is_dtensor
from tests.helpers.launch import save_on_rank_zero
from tests.helpers.moe import MoETrainer, moe_config
from tests.scripts.pipeline_runs import gathered

EP2 = DeviceParameters(expert_parallel=2)  # dp_shard 'auto': every rank
MODES: dict[str, tuple[DeviceParameters, int, int, dict[str, Any]]] = {
    # name: (device parameters, micro-batch, accumulation, config fields)
    "ddp": (DeviceParameters.DDP(), 2, 2, {}),
    "fsdp": (DeviceParameters.FSDP(), 4, 1, {}),
    "ep2": (EP2, 4, 1, {}),  # 2 ranks: each holds 2 of the 4 experts
    "ep2_items": (EP2, 2, 2, {"weighted": True}),
    "ep2_efsdp2": (EP2, 2, 1, {}),  # 4 ranks: experts split in 2, each half sharded over 2
}


class Recording(MoETrainer):
    def post_fit(self) -> None:
        super().post_fit()
        model = getattr(self.model, "module", self.model)
        self.final = gathered(dict(model.named_parameters()))  # collective under FSDP2
        self.final["moe.expert_bias"] = self.moe().expert_bias.clone()
        w1 = self.moe().experts.w1  # FSDP2's sharded parameter
        self.held = {"shape": tuple(w1.to_local().shape),
                     "mesh": w1.device_mesh.mesh_dim_names} if is_dtensor(w1) else None
        ema = next((cb for cb in self.callbacks if isinstance(cb, EMA)), None)
        self.averages = None if ema is None else gathered(  # full tensors: a collective
            {key: value for key, value in ema.state_dict().items() if key != "num_updates"})

def run(mode: str) -> dict[str, Any]:
    if mode == "ep_error":  # 3 experts cannot split over 2 ranks
        trainer = MoETrainer(moe_config(4, 1, EP2, experts=3))
        try:
            trainer.fit()
        except ValueError as error:
            return {"error": str(error)}
        return {"error": None}
    params, batch, accumulation, fields = MODES[mode]
    summary = io.StringIO()
    callbacks: list[Any] = [ModelSummary(max_depth=0, stream=summary)]
    if mode == "ep2":  # the averages of sharded experts, as one process's
        callbacks.append(EMA(decay=0.5))
    trainer = Recording(moe_config(batch, accumulation, params, **fields, callbacks=callbacks))
    trainer.fit()
    return {"final": trainer.final, "loads": trainer.loads, "steps": trainer.global_step,
            "grad_norms": trainer.grad_norms, "summary": summary.getvalue(),
            "averages": trainer.averages,
            "ep_group": trainer.moe().ep_group is not None, "held": trainer.held}


def main(out: str, *modes: str) -> None:
    save_on_rank_zero({mode: run(mode) for mode in modes}, out, "moe_ranks")


if __name__ == "__main__":
    main(*sys.argv[1:])
