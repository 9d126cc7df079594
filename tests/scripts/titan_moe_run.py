"""Script: a model written with torchtitan-style MoE modules (``tests/helpers/titan_moe.py``),
converted to ``MoE`` layers by ``replace_torchtitan_moe_blocks``, loaded with
``init_weights_from`` from files in torchtitan's layout (experts ``[E, hidden, dim]``, the
router under ``router.gate.weight``, and ``embed.weight`` stored flat to exercise a key map
function read whole) through ``torchtitan_moe_key``, trained 3 SGD steps with bias balancing,
and exported back to that layout from inside the run (ROOT/export_<layout>). Rank 0 saves the
full weights after the load and at the end, the balancing biases, and the file boxes each
rank read (key, offsets, lengths).

    torchrun --nproc_per_node=2 titan_moe_run.py OUT ROOT PRETRAINED LAYOUT
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any
from unittest import mock

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from dream_trainer import BaseTrainer, BaseTrainerConfig
from dream_trainer.configs import DeviceParameters, TrainingParameters
from dream_trainer.mixins import SetupConfigMixin, SetupMixin
from dream_trainer.nn import replace_torchtitan_moe_blocks
from dream_trainer.weights import TransformedKey, torchtitan_moe_key
from dream_trainer.weights.hf_reader import SliceReader
from tests.helpers.launch import save_on_rank_zero
from tests.helpers.titan_moe import DIM, TitanModel
from tests.scripts.layout_matrix import everyone, full

LAYOUTS = {"one": DeviceParameters.SINGLE_DEVICE(),
           "ep2": DeviceParameters(device="cpu", expert_parallel=2)}  # FSDP2 over 2 ranks too
GLOBAL_BATCH, STEPS, LR, BIAS_RATE = 16, 3, 0.1, 0.05
FLAT = TransformedKey("embed.weight", to_model=lambda t: t.reshape(DIM, 4),
                      to_file=lambda t: t.reshape(-1))
"""``embed.weight`` as the files hold it: flat (a function, read whole on every rank)."""


def titan_model() -> TitanModel:
    """The torchtitan-style model, bias balancing on and a shared expert."""
    return TitanModel(num_shared_experts=1, load_balance_coeff=BIAS_RATE)


def pretrained_files(model: TitanModel) -> dict[str, torch.Tensor]:
    """The model's state dict as files in torchtitan's layout hold it (``embed.weight``
    flat)."""
    state = {key: value.detach().clone() for key, value in model.state_dict().items()}
    state["embed.weight"] = state["embed.weight"].reshape(-1)
    return state


class TitanConfig(BaseTrainerConfig, SetupConfigMixin):
    pass


class TitanTrainer(BaseTrainer, SetupMixin):
    """SGD on a regression; records the full weights after setup and at the end."""

    config: TitanConfig
    export_dir: Path
    read: list[Any]  # the file boxes this rank's reader read, filled during the load

    def configure_models(self) -> None:
        self.model = titan_model()
        replace_torchtitan_moe_blocks(self.model)

    def map_pretrained_key(self, model_name: str, key: str) -> str | TransformedKey | None:
        return FLAT if key == "embed.weight" else torchtitan_moe_key(key)

    def map_exported_key(self, model_name: str, key: str) -> str | TransformedKey | None:
        return FLAT if key == "embed.weight" else torchtitan_moe_key(key, to="file")

    def configure_optimizers(self) -> None:
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=LR)

    def configure_dataloaders(self) -> tuple[DataLoader[Any], None]:
        x = torch.randn(GLOBAL_BATCH * STEPS, 4, generator=torch.Generator().manual_seed(0))
        data = TensorDataset(x, x.sum(dim=1, keepdim=True))
        return DataLoader(data, batch_size=self.config.training_parameters.train_batch_size), None

    def training_step(self, batch: Any, batch_idx: int) -> dict[str, Any]:
        x, y = batch
        loss = F.mse_loss(self.model(x), y)
        self.backward(loss)
        self.step(self.model, self.optimizer)
        return {"loss": loss}

    def validation_step(self, batch: Any, batch_idx: int) -> dict[str, Any]:
        return {}

    def weights(self) -> dict[str, torch.Tensor]:
        return {name: full(tensor) for name, tensor in self.model.state_dict().items()}

    def post_setup(self) -> None:
        super().post_setup()
        self.read_by_rank = everyone(sorted(self.read))
        self.initial = self.weights()

    def post_fit(self) -> None:
        super().post_fit()
        self.final = self.weights()
        self.export_weights(self.export_dir)


def run(layout: str, pretrained: Path, root: Path, read: list[Any] | None = None
        ) -> TitanTrainer:
    ranks = 1 if layout == "one" else 2
    config = TitanConfig(project="titan", group="tests", experiment=layout, seed=3,
                         init_weights_from=pretrained, device_parameters=LAYOUTS[layout],
                         training_parameters=TrainingParameters(
                             n_epochs=1, train_batch_size=GLOBAL_BATCH // ranks))
    trainer = TitanTrainer(config)
    trainer.export_dir = root / f"export_{layout}"
    trainer.read = [] if read is None else read
    trainer.fit()
    return trainer


def recording_reads() -> tuple[list[tuple[str, list[int], list[int]]], Any]:
    """A list that fills with the boxes ``SliceReader`` reads, and the patch that fills it."""
    read: list[tuple[str, list[int], list[int]]] = []
    original = SliceReader.read_data

    def recording(reader: SliceReader, plan: Any, planner: Any) -> Any:
        read.extend((item.storage_index.fqn, list(item.storage_offsets), list(item.lengths))
                    for item in plan.items)
        return original(reader, plan, planner)

    return read, mock.patch.object(SliceReader, "read_data", recording)


def main(out: str, root: str, pretrained: str, layout: str) -> None:
    read, patch = recording_reads()
    with patch:
        trainer = run(layout, Path(pretrained), Path(root), read)
    result = {"initial": trainer.initial, "final": trainer.final, "read": trainer.read_by_rank,
              "export": str(trainer.export_dir)}
    save_on_rank_zero(result, out, "titan_moe_run")


if __name__ == "__main__":
    main(*sys.argv[1:])
