"""The public set-up phase, the one-window step that plan drives, and no private reach-ins."""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch
import torch.distributed as dist

from dream_trainer.callbacks import Callback
from tests.helpers.launch import REPO
from tests.helpers.toy import ToyTrainer, toy_config


class Hooks(Callback):
    def __init__(self) -> None:
        self.fired: list[str] = []

    def post_setup(self) -> None:
        self.fired.append("post_setup")

    def pre_fit(self) -> None:
        self.fired.append("pre_fit")

    def post_optimizer_step(self, model: Any, optimizer: Any) -> None:
        self.fired.append("post_optimizer_step")


def test_set_up_builds_what_fit_trains_and_leaves_teardown_to_the_caller() -> None:
    hooks = Hooks()
    trainer = ToyTrainer(toy_config(callbacks=[hooks], n_samples=80,
                                    gradient_accumulation_steps=2))
    try:
        trainer.set_up()
        assert dist.is_initialized() and hooks.fired == ["post_setup"]
        assert list(trainer.named_models()) == ["model"] and trainer.named_optimizers()
        assert trainer.train_steps_per_epoch == 80 // 8 // 2
        before = [p.detach().clone() for p in trainer.model.parameters()]
        trainer.train_window(list(trainer.train_dataloader)[:2])
        assert (trainer.global_step, trainer.local_batches) == (1, 2)
        assert hooks.fired == ["post_setup", "post_optimizer_step"]  # one step, no fit hooks
        assert not trainer.training
        assert any(not torch.equal(a, b) for a, b in zip(before, trainer.model.parameters()))
        with pytest.raises(ValueError, match="got 1 micro-batches but one optimizer step "
                                             "takes gradient_accumulation_steps=2"):
            trainer.train_window(list(trainer.train_dataloader)[:1])
    finally:
        trainer.teardown()
        trainer.world.shutdown()
    assert not dist.is_initialized()


def test_train_steps_per_epoch_is_read_only_and_zero_before_setup() -> None:
    trainer = ToyTrainer(toy_config())
    assert trainer.train_steps_per_epoch == 0
    with pytest.raises(AttributeError):
        trainer.train_steps_per_epoch = 3  # type: ignore[misc]


def test_no_cli_module_or_callback_reaches_a_private_trainer_member() -> None:
    pattern = re.compile(r"\btrainer\._[a-z]")
    offenders = [f"{path.relative_to(REPO)}:{number}: {line.strip()}"
                 for folder in ("dream_trainer/cli", "dream_trainer/callbacks")
                 for path in sorted((REPO / folder).rglob("*.py"))
                 for number, line in enumerate(path.read_text().splitlines(), 1)
                 if pattern.search(line)]
    assert offenders == []


class Redirect(Callback):
    """A tool's callback: replaces the run's config from pre_configure, after launch."""

    def __init__(self, update: dict[str, Any]) -> None:
        self.update = update

    def pre_configure(self) -> None:
        trainer = self.trainer
        trainer.replace_config(trainer.config.model_copy(update=self.update))


def test_replace_config_is_the_seam_tools_use_before_configure() -> None:
    hooks = Hooks()
    trainer = ToyTrainer(toy_config(callbacks=[hooks]))
    original = trainer.config
    # Before launch: another config, and its callbacks replace the trainer's.
    quiet = original.model_copy(update={"callbacks": [], "lr": 0.5})
    trainer.replace_config(quiet)
    assert trainer.config is quiet and list(trainer.callbacks) == []
    assert original.lr == 1e-2  # configs are never mutated
    with pytest.raises(TypeError, match="replace_config\\(\\) takes a ToyConfig, got dict"):
        trainer.replace_config({})  # type: ignore[arg-type]
    wider = original.model_copy(update={"device_parameters": original.device_parameters
                                        .model_copy(update={"dp_shard": 2})})
    with pytest.raises(ValueError, match=r"cannot change the mesh \(dp_shard\)"):
        trainer.replace_config(wider)

    # From pre_configure (after launch): the config, not the callbacks.
    redirect = Redirect({"optimizer": "sgd"})
    trainer = ToyTrainer(toy_config(callbacks=[redirect], max_steps=1))
    trainer.fit()
    assert trainer.config.optimizer == "sgd"
    assert isinstance(trainer.optimizer, torch.optim.SGD)
    sneaky = Redirect({"callbacks": []})
    with pytest.raises(RuntimeError, match="from a hook cannot change the callbacks"):
        ToyTrainer(toy_config(callbacks=[sneaky])).fit()
    with pytest.raises(RuntimeError, match="after the models were configured"):
        trainer.replace_config(trainer.config)
