"""val_batch_size not given: every validation loader keeps its own batch size; given, it binds."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import BatchSampler, DataLoader, SequentialSampler

from tests.helpers.tolerance import assert_close_to_scale
from tests.helpers.toy import ToyTrainer, toy_config, toy_dataset


class OwnSizes(ToyTrainer):
    """Validation loaders built as a user writes them, with sizes of their own."""

    sets: dict[str, int] = {}

    def configure_dataloaders(self) -> tuple[DataLoader[Any], Any]:
        train, _ = super().configure_dataloaders()
        loaders = {name: DataLoader(toy_dataset(n, self.config, seed=2 + i), batch_size=size)
                   for i, (name, (n, size)) in enumerate(self.sets.items())}
        return train, (loaders.pop("") if "" in loaders else loaders)

    def validation_step(self, batch: Any, batch_idx: int) -> dict[str, Any]:
        self.seen_sizes.setdefault(self.validation_set, set()).add(len(batch[0]))
        return super().validation_step(batch, batch_idx)

    def pre_val_epoch(self) -> None:
        self.seen_sizes: dict[str | None, set[int]] = {}

    def post_val_epoch(self, result: dict[str, Any]) -> None:
        # Each set's mean over its own samples, as one pass over the whole set gives it.
        self.result = result
        with torch.no_grad():
            self.expected = {name: float(F.mse_loss(self.model(x), y)) for name, (x, y) in (
                (name, toy_dataset(n, self.config, seed=2 + i)[:])
                for i, (name, (n, _)) in enumerate(self.sets.items()))}


def test_one_loader_keeps_its_own_batch_size() -> None:
    OwnSizes.sets = {"": (32, 5)}
    trainer = OwnSizes(toy_config())
    assert trainer.config.training_parameters.val_batch_size == 8  # reads as train's
    trainer.fit()
    assert trainer.seen_sizes == {None: {5, 2}}  # 6 batches of 5 and one of 2
    # float32 sums in batches of another size than one pass: rounding only.
    assert_close_to_scale(trainer.result["val_loss"], trainer.expected[""], ulps=16,
                          dtype=torch.float32)


def test_named_loaders_keep_their_own_batch_sizes() -> None:
    OwnSizes.sets = {"small": (20, 3), "large": (24, 12)}
    trainer = OwnSizes(toy_config())
    trainer.fit()
    assert trainer.seen_sizes == {"small": {3, 2}, "large": {12}}
    for name in OwnSizes.sets:
        # float32 sums in batches of another size than one pass: rounding only.
        assert_close_to_scale(trainer.result[f"{name}/val_loss"], trainer.expected[name],
                              ulps=16, dtype=torch.float32, msg=name)


def test_a_given_val_batch_size_that_disagrees_is_refused() -> None:
    OwnSizes.sets = {"small": (20, 3), "large": (24, 12)}
    with pytest.raises(ValueError, match=r"the validation 'large' loader has batch_size=12 but "
                                         r"training_parameters.val_batch_size=3"):
        OwnSizes(toy_config(val_batch_size=3)).fit()


def test_a_loader_with_a_batch_sampler_has_no_batch_size_to_check() -> None:
    class Sampled(ToyTrainer):
        def configure_dataloaders(self) -> tuple[DataLoader[Any], Any]:
            train, _ = super().configure_dataloaders()
            data = toy_dataset(32, self.config, seed=2)
            sampler = BatchSampler(SequentialSampler(data), batch_size=6, drop_last=False)
            return train, DataLoader(data, batch_sampler=sampler)

    Sampled(toy_config(val_batch_size=4)).fit()  # batch_size is None: nothing to compare
