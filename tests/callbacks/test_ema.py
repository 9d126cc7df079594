"""EMA: the average it keeps, validation on it, FSDP2 shards, and its state in checkpoints.

Exactness: the callback updates with ``lerp``, so a hand-written ``torch.lerp`` over the same
recorded weights must agree bit for bit. The textbook ``decay * shadow + (1 - decay) * weight``
rounds differently (two products and a sum instead of one fused difference), by ~1e-8 per
element here (up to 3 ulps of the scale seen on AVX512, AVX2 and ATen's default kernels),
hence 16 ulps of each tensor's scale, which a missed or extra update (~1e-3) would exceed.
FSDP2 runs add partial gradients in another order than one process, so they agree with it to
16 ulps of the scale (see tests/parallel/test_parallel_modes.py).
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

from dream_trainer.callbacks import Callback
from dream_trainer.callbacks.ema import EMA
from dream_trainer.configs import CheckpointParameters, TrainingParameters
from tests.helpers.checkpointing import CheckpointedConfig, CheckpointedTrainer
from tests.helpers.launch import REPO, check, torchrun
from tests.helpers.tolerance import assert_close_to_scale
from tests.helpers.toy import ToyTrainer, toy_config
from tests.scripts import ema_run

SCRIPT = REPO / "tests/scripts/ema_run.py"


def weights(trainer: ToyTrainer) -> dict[str, torch.Tensor]:
    return {f"model.{k}": v.detach().clone() for k, v in trainer.model.named_parameters()}


def shadows(ema: EMA) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in ema.state_dict().items() if isinstance(v, torch.Tensor)}


class StepLog(Callback):
    """The weights after setup and after every optimizer step (placed after the EMA)."""

    def post_setup(self) -> None:
        self.steps = [weights(self.trainer)]

    def post_train_batch(self, result: dict[str, Any], batch_idx: int) -> None:
        if not self.trainer.is_accumulating_gradients:
            self.steps.append(weights(self.trainer))


@pytest.mark.parametrize(("every", "accumulation"), [(1, 1), (3, 2)])
def test_average_equals_one_computed_by_hand(every: int, accumulation: int) -> None:
    decay = 0.9
    ema, log = EMA(decay=decay, every_n_steps=every), StepLog()
    trainer = ToyTrainer(toy_config(callbacks=[ema, log],
                                    gradient_accumulation_steps=accumulation))
    trainer.fit()
    lerped = dict(log.steps[0])
    textbook = dict(log.steps[0])
    for step, after in enumerate(log.steps[1:], start=1):
        if step % every:
            continue
        for key, weight in after.items():
            lerped[key] = torch.lerp(lerped[key], weight, 1 - decay)
            textbook[key] = decay * textbook[key] + (1 - decay) * weight
    averaged = shadows(ema)
    assert averaged.keys() == lerped.keys() == {"model.0.weight", "model.0.bias",
                                                 "model.3.weight", "model.3.bias"}
    for key in lerped:
        assert torch.equal(averaged[key], lerped[key]), key
        assert_close_to_scale(averaged[key], textbook[key], ulps=16, msg=key)
        # Not vacuous: the average lags the trained weights.
        assert (averaged[key] - log.steps[-1][key]).abs().max() > 1e-3, key
    assert ema.num_updates == (len(log.steps) - 1) // every == trainer.global_step // every


class ValidationLog(ToyTrainer):
    """Records the first-layer weight that each validation pass runs with."""

    def post_setup(self) -> None:
        super().post_setup()
        self.seen: list[torch.Tensor] = []

    def validation_step(self, batch: Any, batch_idx: int) -> dict[str, Any]:
        if batch_idx == 0:
            self.seen.append(self.model[0].weight.detach().clone())
        return super().validation_step(batch, batch_idx)


class AverageAtValidation(Callback):
    """The EMA's first-layer average when each validation pass starts."""

    def __init__(self, ema: EMA) -> None:
        self.ema, self.averages = ema, []

    def pre_val_epoch(self) -> None:
        self.averages.append(self.ema.state_dict()["model.0.weight"].clone())


def test_validation_runs_on_the_average_and_training_on_the_weights() -> None:
    schedule = {"n_epochs": 2, "val_every_n_steps": 7, "num_sanity_val_steps": 1}
    ema = EMA(decay=0.8)
    at_validation = AverageAtValidation(ema)
    with_ema = ValidationLog(toy_config(callbacks=[ema, at_validation], **schedule))
    with_ema.fit()
    without = ValidationLog(toy_config(**schedule))
    without.fit()

    # The sanity check and the validations at steps 7, 14, 21, 28, 35.
    assert len(with_ema.seen) == len(at_validation.averages) == 6
    for seen, average in zip(with_ema.seen, at_validation.averages):
        assert torch.equal(seen, average)
    assert torch.equal(with_ema.seen[0], without.seen[0])  # nothing averaged in yet
    for seen, trained in zip(with_ema.seen[1:], without.seen[1:]):
        assert (seen - trained).abs().max() > 1e-3
    # Training continued from the trained weights after every validation.
    for key, tensor in weights(without).items():
        assert torch.equal(weights(with_ema)[key], tensor), key


def test_arguments_are_validated() -> None:
    for decay in (0.0, 1.0, -0.5, 1.5, float("nan")):
        with pytest.raises(ValueError, match="decay"):
            EMA(decay=decay)
    for every in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="every_n_steps"):
            EMA(every_n_steps=every)  # type: ignore[arg-type]


class Snapshot(Callback):
    """Another callback's state right after setup."""

    def __init__(self, ema: EMA) -> None:
        self.ema = ema

    def post_setup(self) -> None:
        self.state = {k: v.clone() if isinstance(v, torch.Tensor) else v
                      for k, v in self.ema.state_dict().items()}


def test_state_dict_round_trip() -> None:
    trained = EMA(decay=0.9)
    ToyTrainer(toy_config(callbacks=[trained])).fit()
    saved = trained.state_dict()
    assert saved["num_updates"] == 20

    # Into a set-up EMA whose averages differ.
    other = EMA(decay=0.9)
    ToyTrainer(toy_config(callbacks=[other], seed=7, max_steps=2)).fit()
    assert not torch.equal(other.state_dict()["model.0.weight"], saved["model.0.weight"])
    other.load_state_dict(saved)
    for key, value in saved.items():
        assert torch.equal(other.state_dict()[key], value) if key != "num_updates" \
            else other.state_dict()[key] == value

    # Into a fresh EMA before fit(): kept, and applied once its trainer is set up.
    fresh = EMA(decay=0.9)
    fresh.load_state_dict(saved)
    assert fresh.state_dict().keys() == saved.keys()
    snapshot = Snapshot(fresh)
    ToyTrainer(toy_config(callbacks=[fresh, snapshot], seed=7, max_steps=1)).fit()
    for key, value in saved.items():
        assert torch.equal(snapshot.state[key], value) if key != "num_updates" \
            else snapshot.state[key] == value

    with pytest.raises(ValueError, match=r"missing \['model.0.bias'\]"):
        other.load_state_dict({k: v for k, v in saved.items() if k != "model.0.bias"})


def ema_checkpoint_config(root: Path, **training: Any) -> CheckpointedConfig:
    """The checkpointed toy (dropout, shuffling, accumulation) with an EMA, saving every 4
    steps."""
    return CheckpointedConfig(
        project="ckpt", group="tests", experiment="ema", dropout=0.2, shuffle=True,
        n_samples=80, val_samples=16, callbacks=[EMA(decay=0.9)],
        training_parameters=TrainingParameters(n_epochs=2, train_batch_size=4,
                                               gradient_accumulation_steps=2, **training),
        checkpoint_parameters=CheckpointParameters(root_dir=root, every_n_steps=4,
                                                   every_n_epochs=None, resume="latest"))


def test_resumed_run_ends_with_the_uninterrupted_average(tmp_path: Path) -> None:
    uninterrupted = CheckpointedTrainer(ema_checkpoint_config(tmp_path / "whole"))
    uninterrupted.fit()

    # Stop after step 6, then resume from the periodic checkpoint at step 4, as after a crash:
    # the average saved at a step must already include that step.
    first = CheckpointedTrainer(ema_checkpoint_config(tmp_path / "split", max_steps=6))
    first.fit()
    shutil.rmtree(first.checkpoint_dir / "step_6")
    resumed = CheckpointedTrainer(ema_checkpoint_config(tmp_path / "split"))
    resumed.fit()

    expected, actual = uninterrupted.callbacks[0].state_dict(), resumed.callbacks[0].state_dict()
    assert actual.keys() == expected.keys()
    assert actual["num_updates"] == expected["num_updates"] == 20
    for key, tensor in expected.items():
        if key != "num_updates":
            assert torch.equal(actual[key], tensor), key


# -- FSDP2 ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    out = tmp_path_factory.mktemp("ema")
    check(torchrun(SCRIPT, [str(out / "fsdp.pt"), str(out / "checkpoints"), "fsdp"], nproc=2,
                   timeout=300))
    return {"single": ema_run.run("single", out / "checkpoints"),
            "fsdp": torch.load(out / "fsdp.pt")}


def assert_params(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert actual.keys() == expected.keys()
    for name, tensor in expected.items():
        assert_close_to_scale(actual[name], tensor, ulps=16, msg=name)


@pytest.mark.distributed
def test_fsdp_average_equals_single_process(runs: dict[str, dict[str, Any]]) -> None:
    single, fsdp = runs["single"], runs["fsdp"]
    assert fsdp["global_step"] == single["global_step"] == 6
    # Each rank averaged only its shard: the averages were DTensors.
    assert {t for k, t in fsdp["ema_types"].items() if k != "num_updates"} == {"DTensor"}
    assert_params(fsdp["ema"], single["ema"])
    moved = (single["ema"]["model.head.weight"] - single["final"]["head.weight"]).abs().max()
    assert moved > 1e-3
    # Validation (sanity check, steps 2, 4, 6) ran on the average in both ...
    assert_close_to_scale(fsdp["val_losses"], single["val_losses"], ulps=16, dtype=torch.float32)
    # ... and training resumed from the gathered trained weights, not stale averaged ones.
    assert_params(fsdp["final"], single["final"])


@pytest.mark.distributed
@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # one process on purpose
def test_fsdp_average_is_checkpointed_sharded(runs: dict[str, dict[str, Any]]) -> None:
    """DCP saved each rank's shard of the averages; one process reassembles them."""
    reader = dcp.FileSystemReader(runs["fsdp"]["checkpoint"])
    prefix = "state.trainer.callbacks.EMA."
    entries = {key: meta for key, meta in reader.read_metadata().state_dict_metadata.items()
               if key.startswith(prefix) and hasattr(meta, "chunks")}
    assert all(len(meta.chunks) == 2 for meta in entries.values())
    loaded = {key: torch.empty(meta.size) for key, meta in entries.items()}
    dcp.load(loaded, storage_reader=reader, no_dist=True)
    assert_params({key.removeprefix(prefix): tensor for key, tensor in loaded.items()},
                  runs["single"]["ema"])
