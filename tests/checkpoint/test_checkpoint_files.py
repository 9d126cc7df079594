"""Checkpoint files: layout, retention, damage, incompatibility, weights-only and export."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from dream_trainer.checkpoint import CheckpointError, export_checkpoint
from dream_trainer.checkpoint.directory import checksum_share, complete_checkpoints
from dream_trainer.configs import CheckpointParameters
from tests.helpers.checkpointing import CheckpointedTrainer, checkpointed_config, final_state


def train(root: Path, epochs: int = 1, **checkpoint: Any) -> CheckpointedTrainer:
    config = checkpointed_config(root, **checkpoint)
    config = config.model_copy(update={"training_parameters": config.training_parameters
                                       .model_copy(update={"n_epochs": epochs})})
    trainer = CheckpointedTrainer(config)
    trainer.fit()
    return trainer


def checkpoints(root: Path) -> Path:
    return root / "ckpt/tests/run/checkpoints"


def test_layout_cadence_and_final_save(tmp_path: Path) -> None:
    trainer = train(tmp_path, epochs=2, every_n_steps=3, resume=None)
    names = sorted(p.name for p in checkpoints(tmp_path).iterdir())
    # Steps 3, 6, 9, 12, 15, 18; epoch ends 10 and 20 (the final save coincides with 20).
    assert names == sorted(f"step_{s}" for s in (3, 6, 9, 10, 12, 15, 18, 20))
    last = checkpoints(tmp_path) / "step_20"
    assert {".metadata", "dream_trainer.json", "config.json"} <= {p.name for p in last.iterdir()}
    assert json.loads((last / "config.json").read_text())["project"] == "ckpt"
    assert json.loads((last / "dream_trainer.json").read_text())["step"] == trainer.global_step


@pytest.mark.parametrize(("mode", "expected"), [("min", {"step_4", "step_10"}),
                                                ("max", {"step_8", "step_10"})])
def test_keep_top_k_keeps_the_best_by_monitor_and_the_newest(tmp_path: Path, mode: str,
                                                           expected: set[str]) -> None:
    scores = {4: -3.5, 8: 7.25, 10: 0.5}  # negative values rank like any other

    class Scored(CheckpointedTrainer):
        def training_step(self, batch: Any, batch_idx: int) -> dict[str, Any]:
            # A result key, so that monitor="score" is found; the value set below ranks.
            return {**super().training_step(batch, batch_idx), "score": 0.0}

        def post_train_batch(self, result: dict[str, Any], batch_idx: int) -> None:
            if not self.is_accumulating_gradients:
                self._latest_results["score"] = scores.get(self.global_step, 100.0)
            super().post_train_batch(result, batch_idx)

    config = checkpointed_config(tmp_path, keep_top_k=1, monitor="score", mode=mode,
                                 every_n_epochs=None, resume=None)
    config = config.model_copy(update={"training_parameters": config.training_parameters
                                       .model_copy(update={"n_epochs": 1, "max_steps": 10})})
    Scored(config).fit()
    assert {p.name for p in checkpoints(tmp_path).iterdir()} == expected


def test_monitor_that_nothing_produces_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="monitor='val_acc' is not produced.*'val_loss'"):
        train(tmp_path, monitor="val_acc", keep_top_k=2, resume=None)


def test_incomplete_checkpoint_is_skipped_and_the_previous_one_used(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="dream_trainer")
    train(tmp_path, resume=None)
    broken = checkpoints(tmp_path) / "step_10"
    (broken / ".metadata").unlink()
    assert [info.step for info in complete_checkpoints(checkpoints(tmp_path))] == [4, 8]
    resumed = train(tmp_path, resume="latest")
    assert "skipping" in caplog.text and "step_10" in caplog.text
    assert "resumed from" in caplog.text and "step_8" in caplog.text
    assert resumed.global_step == 10


def test_truncated_data_file_is_named(tmp_path: Path) -> None:
    train(tmp_path, resume=None)
    data = checkpoints(tmp_path) / "step_10" / "__0_0.distcp"
    data.write_bytes(data.read_bytes()[:100])
    with pytest.raises(CheckpointError, match=r"__0_0\.distcp is truncated: 100 bytes"):
        train(tmp_path, resume=checkpoints(tmp_path) / "step_10")


@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 6])
def test_checksums_are_shared_out_so_each_rank_reads_the_files_it_wrote(world_size: int) -> None:
    # Written by 4 ranks with 2 files each, plus files of no rank.
    written = [f"__{writer}_{index}.distcp" for writer in range(4) for index in range(2)]
    names = [*written, ".metadata", "config.json", "__x_0.distcp", "extra.bin"]
    shares = [checksum_share(names, rank, world_size) for rank in range(world_size)]
    assert sorted(name for share in shares for name in share) == sorted(names)  # once each
    for rank, share in enumerate(shares):
        assert [name for name in share if name in written] \
            == [name for name in written if int(name[2]) % world_size == rank]
    # The rest is dealt evenly.
    counts = [sum(name not in written for name in share) for share in shares]
    assert max(counts) - min(counts) <= 1


def test_damaged_metadata_is_named(tmp_path: Path) -> None:
    train(tmp_path, resume=None)
    step = checkpoints(tmp_path) / "step_10"
    (step / ".metadata").write_bytes(b"not a pickle")
    # The recorded checksum finds the damage before anything parses the file...
    with pytest.raises(CheckpointError, match=r"step_10/\.metadata does not match the "
                                              r"checksum recorded .* it was not parsed"):
        train(tmp_path, resume=step)
    # ...and without one (a checkpoint written before checksums), the decoder names it.
    info = json.loads((step / "dream_trainer.json").read_text())
    (step / "dream_trainer.json").write_text(json.dumps({**info, "files": None}))
    with pytest.raises(CheckpointError, match=r"cannot read .*step_10/\.metadata"):
        train(tmp_path, resume=step)


def test_missing_or_unfinished_resume_path_is_explained(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="no checkpoint directory there"):
        train(tmp_path, resume=tmp_path / "nope")
    (tmp_path / "half").mkdir()
    with pytest.raises(CheckpointError, match="not a complete checkpoint"):
        train(tmp_path, resume=tmp_path / "half")


def test_resuming_into_a_different_shape_names_the_keys(tmp_path: Path) -> None:
    train(tmp_path, resume=None)
    config = checkpointed_config(tmp_path, resume=checkpoints(tmp_path) / "step_10")
    wider = CheckpointedTrainer(config.model_copy(update={"hidden": 32}))
    with pytest.raises(CheckpointError, match=r"model\.0\.weight \(checkpoint \(16, 8\), "
                                              r"model \(32, 8\)\).*model\.3\.weight"):
        wider.fit()


def test_latest_without_checkpoints_starts_fresh(tmp_path: Path) -> None:
    assert train(tmp_path, resume="latest").global_step == 10


def test_weights_only_starts_training_afresh_from_the_weights(tmp_path: Path) -> None:
    source = train(tmp_path / "source", resume=None)
    weights = final_state(source)["weights"]

    class Capture(CheckpointedTrainer):
        def pre_fit(self) -> None:
            super().pre_fit()
            self.start = {k: v.clone() for k, v in self.model.state_dict().items()}

    config = checkpointed_config(tmp_path / "tuned", load_weights_only=True,
                                 resume=checkpoints(tmp_path / "source") / "step_10")
    tuned = Capture(config.model_copy(update={"training_parameters": config.training_parameters
                                              .model_copy(update={"n_epochs": 1})}))
    tuned.fit()
    for name, tensor in weights.items():
        assert torch.equal(tuned.start[name], tensor), name
    assert tuned.global_step == 10  # counters started at 0, not at the source's 10


def test_async_save_gives_the_same_checkpoints_and_result(tmp_path: Path) -> None:
    sync = train(tmp_path / "sync", epochs=2, resume=None)
    background = train(tmp_path / "async", epochs=2, resume=None, async_save=True)
    assert ({p.name for p in checkpoints(tmp_path / "sync").iterdir()}
            == {p.name for p in checkpoints(tmp_path / "async").iterdir()})
    for name, tensor in final_state(sync)["weights"].items():
        assert torch.equal(final_state(background)["weights"][name], tensor)
    exported = export_checkpoint(checkpoints(tmp_path / "async") / "step_16",
                                 tmp_path / "export")
    assert set(exported) == {"model"}


def test_export_loads_into_a_plain_module(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    trainer = train(tmp_path, resume=None)
    written = export_checkpoint(checkpoints(tmp_path) / "step_10", tmp_path / "export")
    plain = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Dropout(0.2), nn.Linear(16, 4))
    plain.load_state_dict(load_file(written["model"]))
    for name, tensor in trainer.model.state_dict().items():
        assert torch.equal(plain.state_dict()[name], tensor), name


def test_load_weights_only_needs_a_path() -> None:
    with pytest.raises(ValueError, match="load_weights_only=True needs resume"):
        CheckpointParameters(load_weights_only=True, resume="latest")


def test_resume_logs_how_the_config_changed(tmp_path: Path,
                                            caplog: pytest.LogCaptureFixture) -> None:
    train(tmp_path, resume=None)
    config = checkpointed_config(tmp_path, resume="latest")
    changed = config.model_copy(update={"lr": 0.5, "training_parameters": config
                                        .training_parameters.model_copy(update={"n_epochs": 2})})
    CheckpointedTrainer(changed).fit()
    assert "the config differs from the checkpoint's" in caplog.text
    assert "lr: 0.01 -> 0.5" in caplog.text
    assert "training_parameters.n_epochs: 1 -> 2" in caplog.text
    assert "checkpoint_parameters.resume: None -> 'latest'" in caplog.text


def test_a_fresh_run_refuses_a_directory_holding_another_runs_checkpoints(
        tmp_path: Path) -> None:
    train(tmp_path, epochs=2, resume=None)
    with pytest.raises(CheckpointError, match=r"already holds checkpoints of an earlier run "
                                              r"\(up to step 20\).*resume='latest'"):
        train(tmp_path, epochs=1, keep_top_k=1, resume=None)
    assert max(info.step for info in complete_checkpoints(checkpoints(tmp_path))) == 20


def test_a_resume_after_max_steps_finishes_the_interrupted_epoch(tmp_path: Path) -> None:
    first = CheckpointedTrainer(checkpointed_config(tmp_path, resume=None).model_copy(
        update={"training_parameters": checkpointed_config(tmp_path).training_parameters
                .model_copy(update={"n_epochs": 1, "max_steps": 6})}))
    first.fit()
    resumed = train(tmp_path, epochs=1, resume="latest")
    assert (first.global_step, resumed.global_step) == (6, 10)
