"""Script: the MoE regression with an auxiliary balancing loss (weight 0.1) trained
in several layouts on the same 8 samples per step; rank 0 saves, per mode, each step's
auxiliary loss averaged over the step's micro-batches and ranks, each step's gradients after
their reduction (full tensors by name), each step's ``global_load`` and the final weights.

Usage: moe_balance.py OUT MODE [MODE ...]   (MODE names a layout of ``MODES``; without
torchrun, the one-process modes)
"""

from __future__ import annotations

import sys
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from dream_trainer.callbacks import Callback
from dream_trainer.configs import DeviceParameters, TrainingParameters
from dream_trainer.nn import MoE
from tests.helpers.launch import save_on_rank_zero
from tests.helpers.moe import DIM, EXPERTS, HIDDEN, MoEConfig, MoETrainer
from tests.scripts.pipeline_runs import gathered

MODES: dict[str, tuple[DeviceParameters, int, int]] = {
    # name: (device parameters, micro-batch, accumulation); 8 samples per step in all
    "one": (DeviceParameters.SINGLE_DEVICE(), 8, 1),
    "accumulated": (DeviceParameters.SINGLE_DEVICE(), 4, 2),
    "ddp": (DeviceParameters.DDP(), 4, 1),
    "ddp_accumulated": (DeviceParameters.DDP(), 2, 2),
    "ep2": (DeviceParameters(expert_parallel=2), 4, 1),
    "ep2_accumulated": (DeviceParameters(expert_parallel=2), 2, 2),
}


class BalanceConfig(MoEConfig):
    scope: str = "global_batch"


class Balanced(nn.Module):
    def __init__(self, scope: Any) -> None:
        super().__init__()
        self.embed = nn.Linear(4, DIM)
        self.moe = MoE(DIM, HIDDEN, EXPERTS, top_k=2, aux_loss_weight=0.1,
                       bias_update_rate=0.01, aux_loss_scope=scope)
        self.head = nn.Linear(DIM, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.moe(self.embed(x)))


class BalanceTrainer(MoETrainer):
    """MoETrainer's regression (its loss adds ``aux_loss``); records every call's loss."""

    config: BalanceConfig

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.aux: list[float] = []

    def configure_models(self) -> None:
        self.model = Balanced(self.config.scope)

    def training_step(self, batch: Any, batch_idx: int) -> dict[str, Any]:
        result = super().training_step(batch, batch_idx)
        self.aux.append(float(self.moe().aux_loss.detach()))
        return result

    def post_fit(self) -> None:
        super().post_fit()
        calls = torch.tensor(self.aux).view(self.global_step, -1)  # steps x micro-batches
        if dist.is_initialized():  # every rank's calls: the mean the trainer's loss takes
            everyone: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(everyone, calls)
            calls = torch.cat(everyone, dim=1)
        self.step_aux = calls.mean(dim=1)
        model = getattr(self.model, "module", self.model)
        self.final = gathered(dict(model.named_parameters()))  # collective under FSDP2


class Gradients(Callback):
    """Each step's reduced gradients and the load the auxiliary loss weighed, by name."""

    def __init__(self) -> None:
        self.grads: list[dict[str, torch.Tensor]] = []
        self.global_loads: list[torch.Tensor] = []

    def pre_optimizer_step(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        inner = getattr(model, "module", model)
        self.grads.append(gathered({name: param.grad for name, param
                                    in inner.named_parameters()}))
        if inner.moe.aux_loss_scope == "global_batch":
            self.global_loads.append(inner.moe.global_load.clone())


def run(mode: str, scope: str = "global_batch") -> dict[str, Any]:
    params, batch, accumulation = MODES[mode]
    gradients = Gradients()
    trainer = BalanceTrainer(BalanceConfig(
        project="moe", group="tests", experiment=mode, scope=scope, callbacks=[gradients],
        device_parameters=params,
        training_parameters=TrainingParameters(n_epochs=1, train_batch_size=batch,
                                               gradient_accumulation_steps=accumulation)))
    trainer.fit()
    return {"aux": trainer.step_aux, "grads": gradients.grads, "steps": trainer.global_step,
            "global_loads": gradients.global_loads, "final": trainer.final}


def main(out: str, *modes: str) -> None:
    save_on_rank_zero({mode: run(mode) for mode in modes}, out, "moe_balance")


if __name__ == "__main__":
    main(*sys.argv[1:])
