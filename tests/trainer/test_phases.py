"""Mixins work whether or not user hooks call super(); a missing config mixin fails early."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest

from dream_trainer.configs import LoggingParameters
from dream_trainer.mixins import CheckpointMixin, JSONLoggerConfigMixin, JSONLoggerMixin
from dream_trainer.trainer.hooks import TrainerHooks
from dream_trainer.trainer.phases import handlers, phase_calls, runs_on
from tests.helpers.checkpointing import checkpointed_config
from tests.helpers.metrics import MetricsConfig, MetricsTrainer
from tests.helpers.toy import ToyConfig, ToyTrainer, toy_config


class Forgetful(MetricsTrainer):
    """Every hook a user might override, none calling super()."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.step_at_setup: int | None = None
        self.locked_during_fit = False
        self.logged_in_post_fit = False

    def post_setup(self) -> None:
        self.step_at_setup = self.global_step

    def pre_fit(self) -> None:
        self.locked_during_fit = (self.checkpoint_dir / ".lock").exists()

    def post_train_batch(self, result: dict[str, Any], batch_idx: int) -> None:
        pass

    def post_val_epoch(self, result: dict[str, Any]) -> None:
        if not (self.sanity_checking or self.evaluating):
            self.validated_at.append(self.global_step)

    def end_of_step(self) -> None:
        pass

    def post_fit(self) -> None:
        # Closing work (the logger's finish, the final checkpoint) runs after this hook.
        self.log_dict({"user/final": 1.0})
        self.logged_in_post_fit = True

    def teardown(self) -> None:
        pass

    def extra_state_dict(self) -> dict[str, Any]:
        return {"mine": 1}


def forgetful_config(root: Path, epochs: int) -> MetricsConfig:
    base = checkpointed_config(root, resume="latest")
    return MetricsConfig(**{
        **dict(base), "logging_parameters": LoggingParameters(log_dir=root, log_every_n_steps=4),
        "training_parameters": base.training_parameters.model_copy(update={"n_epochs": epochs}),
    })


def test_hooks_without_super_keep_resume_lock_logging_and_final_checkpoint(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    checkpoints = tmp_path / "ckpt/tests/run/checkpoints"
    first = Forgetful(forgetful_config(tmp_path, epochs=1))
    with caplog.at_level(logging.ERROR):
        first.fit()
    assert first.step_at_setup == 0 and first.locked_during_fit
    assert (checkpoints / "step_10").is_dir()  # the final checkpoint, from post_fit
    assert not (checkpoints / ".lock").exists()  # released although teardown skipped super()
    assert "Forgetful.teardown() did not call super().teardown()" in caplog.text
    rows = [json.loads(line)
            for line in (tmp_path / "ckpt/tests/run/logs/metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows if "trainer/global_step" in row] == [4, 8]
    assert any("user/final" in row for row in rows) and first.logged_in_post_fit
    assert first.validated_at == [10]

    second = Forgetful(forgetful_config(tmp_path, epochs=2))
    second.fit()
    assert second.step_at_setup == 10  # resumed, though post_setup skipped super()
    assert second.global_step == 20 and (checkpoints / "step_20").is_dir()
    # extra_state_dict skipped super(): the base's entries were saved and restored anyway.
    assert second.validated_at == [10, 20]


def test_a_mixin_without_its_config_mixin_fails_at_construction() -> None:
    class NoCheckpoints(ToyTrainer, CheckpointMixin):
        configured = False

        def configure_models(self) -> None:
            NoCheckpoints.configured = True
            super().configure_models()

    with pytest.raises(TypeError, match=r"NoCheckpoints includes CheckpointMixin, which reads "
                                        r"config.checkpoint_parameters, but its config ToyConfig "
                                        r"has no such field: add CheckpointConfigMixin"):
        NoCheckpoints(toy_config())
    assert not NoCheckpoints.configured

    class Logged(ToyTrainer, JSONLoggerMixin):
        pass

    with pytest.raises(TypeError, match="add JSONLoggerConfigMixin to the bases of ToyConfig"):
        Logged(toy_config())

    class LoggedConfig(ToyConfig, JSONLoggerConfigMixin):
        pass

    Logged(LoggedConfig(**dict(toy_config())))  # with it, construction succeeds


def test_runs_on_refuses_an_unknown_phase() -> None:
    with pytest.raises(ValueError, match=r"runs_on\('post_setpu'\): not a phase"):
        runs_on("post_setpu")


def test_handlers_run_in_the_order_of_a_super_chain() -> None:
    # The order a chain of overrides produces when A and C work before super() and B, D after.
    class Base:
        pass

    class D(Base):
        @runs_on("post_epoch", after_bases=True)
        def d(self) -> None: ...

    class C(Base):
        @runs_on("post_epoch")
        def c(self) -> None: ...

    class B(Base):
        @runs_on("post_epoch", after_bases=True)
        def b(self) -> None: ...

    class A(Base):
        @runs_on("post_epoch")
        def a(self) -> None: ...

    class Trainer(A, B, C, D):
        pass

    # super-chain: A works, B defers, C works, D defers; unwinding runs D's, then B's.
    assert handlers(Trainer, "post_epoch") == ("a", "c", "d", "b")
    assert handlers(Trainer, "pre_epoch") == ()


def test_phase_calls_leave_out_hooks_nobody_overrides() -> None:
    # What _fire runs: handlers, then the public hook (first for a closing phase); a hook left
    # as TrainerHooks' no-op is not called at all, so an unused hook costs no call per step.
    class Quiet(TrainerHooks):
        @runs_on("post_fit")
        def close(self) -> None: ...

    class Busy(Quiet):
        @runs_on("post_train_batch")
        def count(self, result: dict[str, Any], batch_idx: int) -> None: ...

        def post_train_batch(self, result: dict[str, Any], batch_idx: int) -> None: ...

        def post_fit(self) -> None: ...

    assert phase_calls(Quiet, "post_train_batch") == ()
    assert phase_calls(Quiet, "post_fit") == ("close",)
    assert phase_calls(Busy, "post_train_batch") == ("count", "post_train_batch")
    assert phase_calls(Busy, "post_fit") == ("post_fit", "close")
