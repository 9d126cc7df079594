"""torchrun script: the MoE regression in several data- and expert-parallel layouts, each on
the same global batch of 8 samples per step as one process; rank 0 saves, per mode, the final
full weights and balancing bias, each rank's step loads, and the experts this rank held. The
``*_bf16`` modes train the regression in bfloat16 with widths whose experts run as grouped
matrix products, and save the initial weights and how many grouped products ran too.

    torchrun --nproc_per_node=N moe_ranks.py OUT MODE [MODE ...]
"""

from __future__ import annotations

import io
import sys
from typing import Any
from unittest import mock

import torch
import torch.nn.functional as F
from torch import nn

from dream_trainer.callbacks import EMA
from dream_trainer.callbacks.summaries import ModelSummary
from dream_trainer.configs import DeviceParameters
from dream_trainer.nn import MoE
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
    "one_bf16": (DeviceParameters.SINGLE_DEVICE(), 8, 1, {}),
    "ep2_bf16": (EP2, 4, 1, {}),
    "ep2_efsdp2_bf16": (EP2, 2, 1, {}),
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

class Bf16Tiny(nn.Module):
    """The MoE regression in bfloat16, widths 16 (16 bytes of bf16 per row): grouped experts."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(4, 16)
        self.moe = MoE(16, 16, 4, top_k=2, bias_update_rate=0.01)
        self.head = nn.Linear(16, 1)
        self.to(torch.bfloat16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.moe(self.embed(x.to(torch.bfloat16)))).float()


class Bf16Recording(Recording):
    def configure_models(self) -> None:
        self.model = Bf16Tiny()

    def pre_fit(self) -> None:
        super().pre_fit()
        model = getattr(self.model, "module", self.model)
        self.initial = gathered(dict(model.named_parameters()))


def run_bf16(mode: str) -> dict[str, Any]:
    params, batch, accumulation, fields = MODES[mode]
    trainer = Bf16Recording(moe_config(batch, accumulation, params, **fields))
    with mock.patch.object(F, "grouped_mm", wraps=F.grouped_mm) as grouped:
        trainer.fit()
    return {"final": trainer.final, "initial": trainer.initial, "steps": trainer.global_step,
            "held": trainer.held, "grouped_calls": grouped.call_count}


def run(mode: str) -> dict[str, Any]:
    if mode.endswith("_bf16"):
        return run_bf16(mode)
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
