"""The loop's counters and schedule options."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from dream_trainer.callbacks import Callback
from tests.helpers.toy import ToyTrainer, toy_config


class Tally(Callback):
    def __init__(self) -> None:
        self.val_epochs: list[tuple[int, bool]] = []
        self.val_batches = 0
        self.train_results: list[dict[str, Any]] = []
        self.val_results: list[dict[str, Any]] = []

    def pre_val_epoch(self) -> None:
        self.val_epochs.append((self.trainer.global_step, self.trainer.sanity_checking))

    def post_val_batch(self, result: dict[str, Any], batch_idx: int) -> None:
        self.val_batches += 1

    def post_train_epoch(self, result: dict[str, Any]) -> None:
        self.train_results.append(result)

    def post_val_epoch(self, result: dict[str, Any]) -> None:
        self.val_results.append(result)


def run(**kwargs: Any) -> tuple[ToyTrainer, Tally]:
    tally = Tally()
    trainer = ToyTrainer(toy_config(callbacks=[tally], **kwargs))
    trainer.fit()
    return trainer, tally


def test_train_steps_per_epoch_limits_each_epoch() -> None:
    trainer, _ = run(n_epochs=3, n_samples=160, train_steps_per_epoch=4)
    assert (trainer.global_step, trainer.local_batches, trainer.current_epoch) == (12, 12, 3)


def test_max_steps_stops_mid_epoch_and_skips_later_epochs() -> None:
    trainer, tally = run(n_epochs=5, n_samples=160, max_steps=25)
    # The interrupted epoch still finishes its bookkeeping and validates, but stays current:
    # a resume with a larger budget goes on with its remaining batches.
    assert (trainer.global_step, trainer.current_epoch) == (25, 1)
    assert len(tally.train_results) == 2 and [s for s, _ in tally.val_epochs] == [20, 25]
    assert (trainer.state_dict()["current_epoch"], trainer.state_dict()["batch_in_epoch"]) == (1, 5)


def test_val_every_n_steps_replaces_the_epoch_end_validation() -> None:
    trainer, tally = run(n_epochs=2, n_samples=80, val_every_n_steps=4, val_samples=32,
                         val_steps_per_epoch=2)
    assert trainer.global_step == 20
    assert [step for step, _ in tally.val_epochs] == [4, 8, 12, 16, 20]
    assert tally.val_batches == 5 * 2


def test_sanity_validation_runs_first_and_is_flagged() -> None:
    _, tally = run(n_samples=32, num_sanity_val_steps=2, val_samples=32)
    assert tally.val_epochs == [(0, True), (4, False)]
    assert tally.val_batches == 2 + 4


def test_epoch_results_are_means_of_step_results() -> None:
    seen: list[float] = []

    class Recording(ToyTrainer):
        def post_train_batch(self, result: dict[str, Any], batch_idx: int) -> None:
            seen.append(float(result["loss"].detach()))

    tally = Tally()
    Recording(toy_config(n_samples=64, callbacks=[tally])).fit()
    assert tally.train_results[0]["loss"] == pytest.approx(sum(seen) / len(seen), rel=1e-6)
    assert set(tally.train_results[0]) == {"loss", "grad_norm"}
    assert set(tally.val_results[0]) == {"val_loss"}


def test_scheduler_configured_for_the_optimizer_is_stepped() -> None:
    class Scheduled(ToyTrainer):
        def configure_schedulers(self) -> None:
            self.scheduler = torch.optim.lr_scheduler.StepLR(self.optimizer, step_size=1,
                                                             gamma=0.5)

    trainer = Scheduled(toy_config(n_samples=32, lr=1.0))
    trainer.fit()
    assert trainer.named_schedulers() == {"scheduler": trainer.scheduler}
    assert trainer.optimizer.param_groups[0]["lr"] == pytest.approx(0.5 ** 4)


def test_gradient_clipping_bounds_the_update_and_returns_the_unclipped_norm() -> None:
    class Clipped(ToyTrainer):
        def post_setup(self) -> None:
            self.initial = {k: v.clone() for k, v in self.model.state_dict().items()}

        def post_train_batch(self, result: dict[str, Any], batch_idx: int) -> None:
            self.grad_norm = result["grad_norm"]

    trainer = Clipped(toy_config(n_samples=8, optimizer="sgd", lr=1.0, gradient_clip_val=1e-3))
    trainer.fit()
    delta = torch.cat([(trainer.model.state_dict()[k] - v).flatten()
                       for k, v in trainer.initial.items()])
    assert trainer.grad_norm.dim() == 0 and float(trainer.grad_norm) > 1e-3
    # One SGD step with lr=1 moves the weights by exactly the clipped gradient.
    assert float(delta.norm()) == pytest.approx(1e-3, rel=1e-4)


def test_config_is_not_mutated_by_fit() -> None:
    config = toy_config(n_epochs=2, n_samples=32, gradient_accumulation_steps=2)
    before = config.model_dump()
    ToyTrainer(config).fit()
    assert config.model_dump() == before


def test_models_are_created_without_storage() -> None:
    metas: dict[str, bool] = {}

    class Probe(ToyTrainer):
        def post_configure(self) -> None:
            metas.update({name: p.is_meta for name, p in self.model.named_parameters()})

    trainer = Probe(toy_config(n_samples=8))
    trainer.fit()
    assert metas and all(metas.values())
    assert not any(p.is_meta for p in trainer.model.parameters())


def test_state_dict_round_trips_the_counters() -> None:
    trainer, _ = run(n_samples=32)
    state = trainer.state_dict()
    # Between epochs the position is the start of the next one, not the end of the last.
    assert (state["global_step"], state["current_epoch"], state["batch_in_epoch"]) == (4, 1, 0)
    fresh = ToyTrainer(toy_config())
    fresh.load_state_dict(state)
    assert (fresh.global_step, fresh.current_epoch) == (4, 1)


class WithTeacher(ToyTrainer):
    """A frozen teacher with dropout beside the trained model."""

    def configure_models(self) -> None:
        super().configure_models()
        self.teacher = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.Dropout(0.5))
        self.teacher.requires_grad_(False)

    def training_step(self, batch: Any, batch_idx: int) -> dict[str, Any]:
        self.modes = (self.model.training, self.teacher.training, self.teacher[1].training)
        return super().training_step(batch, batch_idx)


def test_a_model_without_trainable_parameters_stays_in_eval_mode_while_training() -> None:
    trainer = WithTeacher(toy_config())
    trainer.fit()
    assert trainer.modes == (True, False, False)


class NoValidationLoader(ToyTrainer):
    def configure_dataloaders(self) -> Any:
        return super().configure_dataloaders()[0], None


def test_evaluate_without_any_loader_names_the_fix() -> None:
    trainer = NoValidationLoader(toy_config())
    trainer.fit()
    with pytest.raises(ValueError, match="evaluate\\(\\) needs a dataloader: pass one"):
        trainer.evaluate()
    loader = ToyTrainer.configure_dataloaders(trainer)[1]
    result = trainer.evaluate(loader, max_batches=2)
    assert list(result) == ["val_loss"] and torch.isfinite(torch.tensor(result["val_loss"]))
