"""Key maps that change a tensor's form (``dream_trainer.weights.TransformedKey``): a
transpose and a function with its inverse, on load (``init_weights_from``) and on export
(``export_weights`` and ``export_checkpoint``), in one process. The 2-rank case (experts
transposed into expert-parallel shards, a function's result into FSDP2 shards) is
``tests/nn/test_titan_moe.py``'s launch."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn
from torch.utils.data import DataLoader

from dream_trainer import BaseTrainer, BaseTrainerConfig
from dream_trainer.checkpoint import CheckpointError, export_checkpoint
from dream_trainer.checkpoint.pretrained import PretrainedWeights
from dream_trainer.configs import CheckpointParameters, DeviceParameters, TrainingParameters
from dream_trainer.mixins import (CheckpointConfigMixin, CheckpointMixin, SetupConfigMixin,
                                  SetupMixin)
from dream_trainer.weights import TransformedKey

FLAT = TransformedKey("b.weight", to_model=lambda t: t.reshape(6, 4),
                      to_file=lambda t: t.reshape(-1))
SWAP = TransformedKey("a.weight", transpose=(0, 1))


class Two(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(5, 3)
        self.b = nn.Linear(4, 6)


def files_of(model: Two) -> dict[str, torch.Tensor]:
    """The model's tensors as the files hold them: ``a.weight`` transposed, ``b.weight``
    flat."""
    state = {key: value.detach().clone() for key, value in model.state_dict().items()}
    state["a.weight"] = state["a.weight"].T.contiguous()
    state["b.weight"] = state["b.weight"].reshape(-1)
    return state


def write(directory: Path, tensors: dict[str, torch.Tensor]) -> Path:
    directory.mkdir()
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    return directory


def read(directory: Path) -> dict[str, torch.Tensor]:
    with safe_open(str(directory / "model.safetensors"), "pt") as file:
        return {key: file.get_tensor(key) for key in file.keys()}


def to_model(name: str, key: str) -> str | TransformedKey | None:
    return {"a.weight": SWAP, "b.weight": FLAT}.get(key, key)


def test_a_transpose_and_a_function_load_exactly(tmp_path: Path) -> None:
    torch.manual_seed(0)
    source = Two()
    path = write(tmp_path / "files", files_of(source))
    model = Two()
    PretrainedWeights({"model": model}, path, to_model, strict=True).load()
    for key, value in source.state_dict().items():
        assert torch.equal(model.state_dict()[key], value), key


@pytest.mark.parametrize(("mapped", "problem"), [
    # Without the transform the shapes differ, and say so (as for any key).
    ("a.weight", "a.weight (file (5, 3), model (3, 5))"),
    (TransformedKey("a.weight", to_model=lambda t: t.reshape(5, 3),
                    to_file=lambda t: t.reshape(3, 5)),
     "a.weight (file (5, 3), transformed (5, 3), model (3, 5))"),
    (TransformedKey("a.weight", to_model=lambda t: t.reshape(7, 2),
                    to_file=lambda t: t.reshape(5, 3)),
     "a.weight (file (5, 3): the key map's transform fails on it: shape '[7, 2]' is invalid "
     "for input of size 15)"),
])
def test_a_transform_that_does_not_fit_is_refused_naming_the_shapes(
        tmp_path: Path, mapped: Any, problem: str) -> None:
    path = write(tmp_path / "files", files_of(Two()))

    def key_map(name: str, key: str) -> str | TransformedKey | None:
        return mapped if key == "a.weight" else to_model(name, key)

    with pytest.raises(CheckpointError, match="shapes differ for ") as error:
        PretrainedWeights({"model": Two()}, path, key_map, strict=True).load()
    assert problem in str(error.value)


def test_a_transformed_key_is_one_kind_of_transform() -> None:
    with pytest.raises(ValueError, match="give transpose or to_model/to_file, not both"):
        TransformedKey("w", transpose=(0, 1), to_model=torch.neg, to_file=torch.neg)
    with pytest.raises(ValueError, match="both to_model .* and to_file"):
        TransformedKey("w", to_model=torch.neg)
    with pytest.raises(ValueError, match=r"transpose=\(1, 1\) must name two different"):
        TransformedKey("w", transpose=(1, 1))
    assert SWAP.model_shape((5, 3)) == (3, 5) and FLAT.file_shape((6, 4)) == (24,)


class Config(BaseTrainerConfig, SetupConfigMixin, CheckpointConfigMixin):
    pass


class Trainer(BaseTrainer, SetupMixin, CheckpointMixin):
    """One SGD step on ``Two``, then an export in the files' layout."""

    config: Config

    def configure_models(self) -> None:
        self.model = Two()

    def map_pretrained_key(self, model_name: str, key: str) -> str | TransformedKey | None:
        return to_model(model_name, key)

    def map_exported_key(self, model_name: str, key: str) -> str | TransformedKey | None:
        return {"a.weight": SWAP, "b.weight": FLAT}.get(key, key)

    def configure_optimizers(self) -> None:
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.1)

    def configure_dataloaders(self) -> tuple[Any, None]:
        return DataLoader([torch.ones(5)] * 2, batch_size=2), None

    def training_step(self, batch: Any, batch_idx: int) -> dict[str, Any]:
        loss = self.model.a(batch).sum() + self.model.b.weight.square().sum()
        self.backward(loss)
        self.step(self.model, self.optimizer)
        return {"loss": loss}

    def validation_step(self, batch: Any, batch_idx: int) -> dict[str, Any]:
        return {}

    def post_fit(self) -> None:
        super().post_fit()
        self.export_weights(self.export_dir)


def test_an_export_applies_the_exported_keys_transforms(tmp_path: Path) -> None:
    torch.manual_seed(0)
    path = write(tmp_path / "files", files_of(Two()))
    trainer = Trainer(Config(
        project="p", group="g", experiment="e", init_weights_from=path,
        device_parameters=DeviceParameters.SINGLE_DEVICE(),
        checkpoint_parameters=CheckpointParameters(root_dir=tmp_path / "runs"),
        training_parameters=TrainingParameters(n_epochs=1, train_batch_size=2)))
    trainer.export_dir = tmp_path / "live"
    trainer.fit()
    expected = files_of(trainer.model)
    checkpoint = trainer.checkpoint_dir / f"step_{trainer.global_step}"
    export_checkpoint(checkpoint, tmp_path / "cli", format="hf", map_key=trainer.map_exported_key)
    for directory in (tmp_path / "live", tmp_path / "cli"):
        exported = read(directory)
        assert exported.keys() == expected.keys()
        for key, value in expected.items():
            assert torch.equal(exported[key], value), (directory.name, key)
    assert not torch.equal(expected["a.weight"], read(path)["a.weight"])  # the step moved it
