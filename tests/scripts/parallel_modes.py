"""Script: train the tiny transformer in several parallel modes, one after another, and save
the full parameters after setup and after training (gathered from every shard)."""

from __future__ import annotations

import sys
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from dream_trainer.configs import DeviceParameters
from tests.helpers.launch import save_on_rank_zero
from tests.helpers.transformer import TransformerTrainer, transformer_config

GLOBAL_BATCH = 8

MODES: dict[str, tuple[DeviceParameters, int, dict[str, Any]]] = {
    # name: (device parameters, data-parallel degree, extra training parameters)
    "single": (DeviceParameters.SINGLE_DEVICE(), 1, {}),
    "single_bf16": (DeviceParameters.SINGLE_DEVICE(param_dtype="bf16"), 1, {}),
    "ddp": (DeviceParameters.DDP(), 2, {}),
    "ddp_accum": (DeviceParameters.DDP(), 2, {"gradient_accumulation_steps": 2}),
    "fsdp": (DeviceParameters.FSDP(), 2, {}),
    "fsdp_accum": (DeviceParameters.FSDP(), 2, {"gradient_accumulation_steps": 2}),
    "fsdp_bf16": (DeviceParameters.FSDP(param_dtype="bf16"), 2, {}),
    "tp": (DeviceParameters(dp_replicate=1, tensor_parallel=2), 1, {}),
    "hsdp": (DeviceParameters.HSDP(dp_shard=2), 4, {}),
    "fsdp_tp": (DeviceParameters(dp_shard=2, tensor_parallel=2), 2, {}),
}


def full(tensor: torch.Tensor) -> torch.Tensor:
    return (tensor.full_tensor() if isinstance(tensor, DTensor) else tensor).detach().clone()


class Recording(TransformerTrainer):
    """Keeps the full parameters after setup and after training.

    Gathering DTensors is a collective, so it happens in hooks, while the group exists.
    """

    def unwrapped(self) -> torch.nn.Module:
        return getattr(self.model, "module", self.model)  # DDP prefixes names with module.

    def post_setup(self) -> None:
        params = dict(self.unwrapped().named_parameters())
        self.initial = {k: full(v) for k, v in params.items()}
        self.placements = {k: tuple(str(p) for p in v.placements)
                           for k, v in params.items() if isinstance(v, DTensor)}

    def post_fit(self) -> None:
        self.final = {k: full(v) for k, v in self.unwrapped().named_parameters()}


def run(mode: str) -> dict[str, Any]:
    params, dp, training = MODES[mode]
    accumulation = training.get("gradient_accumulation_steps", 1)
    trainer = Recording(transformer_config(params, GLOBAL_BATCH // dp // accumulation,
                                           max_steps=4, **training))
    trainer.fit()
    return {"initial": trainer.initial, "placements": trainer.placements,
            "final": trainer.final, "global_step": trainer.global_step}


def main(out: str, modes: list[str]) -> None:
    save_on_rank_zero({mode: run(mode) for mode in modes}, out, "parallel_modes")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
