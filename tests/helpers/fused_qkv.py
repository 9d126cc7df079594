"""A toy model whose state-dict hooks rename its keys, as torchtitan's fused q/k/v layer does,
and the checkpointed toy trainer that trains it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from dream_trainer.configs import CheckpointParameters, DeviceParameters, TrainingParameters
from tests.helpers.checkpointing import CheckpointedConfig, CheckpointedTrainer


class FusedConfig(CheckpointedConfig):
    copies: bool = False  # the hook saves copies of the fused weight's parts, not views


class FusedQKV(nn.Module):
    """One ``wqkv`` weight, saved and loaded as ``wq``, ``wk`` and ``wv`` by its hooks; with
    ``copies``, the saved parts are copies rather than views of the weight (a hook that
    converts), so only the load hook carries loaded values into the weight."""

    def __init__(self, dim: int, copies: bool = False) -> None:
        super().__init__()
        self.wqkv = nn.Linear(dim, 3 * dim, bias=False)
        self.copies = copies
        self._register_state_dict_hook(FusedQKV._split)
        self._register_load_state_dict_pre_hook(FusedQKV._fuse)

    @staticmethod
    def _split(module: nn.Module, state: dict[str, Any], prefix: str, metadata: Any) -> None:
        fused = state.pop(prefix + "wqkv.weight")
        for name, part in zip("qkv", fused.chunk(3)):
            state[f"{prefix}w{name}.weight"] = part.clone() if module.copies else part

    @staticmethod
    def _fuse(state: dict[str, Any], prefix: str, *args: Any) -> None:
        names = [f"{prefix}w{name}.weight" for name in "qkv"]
        if all(name in state for name in names):  # else load_state_dict names what is missing
            state[prefix + "wqkv.weight"] = torch.cat([state.pop(name) for name in names])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.wqkv(x).chunk(3, -1)
        return q * k.sigmoid() + v


class FusedModel(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        self.layers = nn.ModuleDict({str(i): FusedQKV(config.in_features, config.copies)
                                     for i in range(2)})
        self.head = nn.Linear(config.in_features, config.out_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers.values():
            x = layer(x)
        return self.head(x)


class FusedTrainer(CheckpointedTrainer):
    config: FusedConfig

    def configure_models(self) -> None:
        self.model = FusedModel(self.config)


def config(root: Path, steps: int, resume: Any = None, copies: bool = False,
           device_parameters: DeviceParameters | None = None) -> FusedConfig:
    return FusedConfig(
        project="fused", group="tests", experiment="run", n_samples=64, val_samples=8,
        copies=copies, device_parameters=device_parameters or DeviceParameters(),
        training_parameters=TrainingParameters(n_epochs=1, train_batch_size=4,
                                               max_steps=steps),
        checkpoint_parameters=CheckpointParameters(root_dir=root, every_n_steps=2,
                                                   every_n_epochs=None, resume=resume))
