"""NanGuard's diagnosis: the re-run names the module, rank and batch where a non-finite value
first appeared, saves the batch, and leaves the training state exactly as it was."""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from dream_trainer.callbacks import Callback
from dream_trainer.callbacks.nan_guard import NanGuard
from dream_trainer.callbacks.nan_provenance import MicroBatch
from dream_trainer.configs import DeviceParameters
from dream_trainer.parallel.data_parallel import DDPBackend, FSDPBackend
from dream_trainer.world.dims import ParallelDims
from tests.callbacks.test_nan_guard import NanLoss
from tests.helpers.launch import REPO, check, free_port, torchrun
from tests.helpers.provenance import (ProvenanceTrainer, RecordBatch, TrainingState,
                                      assert_same_state)
from tests.helpers.toy import ToyTrainer, toy_config


def provenance_trainer(tmp_path: Path, fault: str, bad_batch: int, *callbacks: Callback,
                       **training: Any) -> tuple[ProvenanceTrainer, NanGuard]:
    guard = NanGuard(output_dir=tmp_path / "nan")
    trainer = ProvenanceTrainer(toy_config(callbacks=[*callbacks, guard], **training))
    trainer.fault, trainer.bad_batch = fault, bad_batch
    return trainer, guard


def test_forward_names_the_innermost_module_and_saves_the_batch(tmp_path: Path) -> None:
    # Micro-batch 7 is the second of step 3's window; Boom's child and parent stay unblamed.
    record = RecordBatch(7)
    trainer, guard = provenance_trainer(tmp_path, "forward", 7, record,
                                        gradient_accumulation_steps=2)
    with pytest.raises(FloatingPointError) as raised:
        trainer.fit()
    report = guard.report
    assert report is not None and report.ranks == [0] and report.step == 3
    (finding,) = report.findings
    assert (finding.kind, finding.module, finding.module_type) == ("forward", "model.1.1", "Boom")
    assert (finding.rank, finding.step, finding.batch_idx, finding.epoch) == (0, 3, 7, 0)
    assert "inputs were finite, its output is not" in finding.detail
    message = str(raised.value)
    assert message.startswith("non-finite values at global step 3 (batch 7 of epoch 0) on "
                              "rank 0:")
    assert "rank 0, batch 7: model.1.1 (Boom) made inf in forward" in message
    # Stopped before the bad update: the loop never counted step 3.
    assert trainer.global_step == 3
    assert finding.batch_file == tmp_path / "nan/toy/tests/run/step_3_rank0.pt"
    saved = torch.load(finding.batch_file, weights_only=True)
    assert (saved["batch_idx"], saved["global_step"], saved["epoch"], saved["rank"]) == (7, 3, 0, 0)
    assert len(saved["batch"]) == 2
    for tensor, trained in zip(saved["batch"], record.batch, strict=True):
        assert torch.equal(tensor, trained)


def test_the_diagnosis_leaves_the_training_state_as_it_was(tmp_path: Path) -> None:
    # Step 4 (batches 8 and 9): AdamW has state, batch norm has running statistics, dropout
    # draws from the generator, and the gradients of both micro-batches are there. The re-run
    # stops after batch 8, whose generator state and `armed` flag differ from batch 9's.
    state = TrainingState(4)
    trainer, _ = provenance_trainer(tmp_path, "forward", 8, state,
                                    gradient_accumulation_steps=2)
    with pytest.raises(FloatingPointError, match=r"model\.1\.1 \(Boom\)"):
        trainer.fit()
    assert state.before is not None and state.after is not None
    assert state.before["optimizer"]["state"], "AdamW should have stepped already"
    assert any(grad is not None for _, grad in state.before["grads"].values())
    assert_same_state(state.before, state.after)


def test_backward_names_the_module_whose_input_gradient_went_non_finite(
        tmp_path: Path) -> None:
    trainer, guard = provenance_trainer(tmp_path, "backward", 5)
    with pytest.raises(FloatingPointError) as raised:
        trainer.fit()
    assert guard.report is not None
    (finding,) = guard.report.findings
    assert (finding.kind, finding.module, finding.module_type) == \
        ("backward", "model.1.1", "SqrtAtZero")
    assert (finding.step, finding.batch_idx) == (5, 5)
    assert "the gradient of its output was finite, the gradient of its input is not" \
        in finding.detail
    assert "model.1.1 (SqrtAtZero) made NaN in backward" in str(raised.value)


def test_a_non_finite_loss_is_blamed_on_the_loss(tmp_path: Path) -> None:
    trainer = NanLoss(toy_config(callbacks=[NanGuard(output_dir=tmp_path)]))
    trainer.nan_step = 2
    with pytest.raises(FloatingPointError, match="the loss, or training_step's code after "
                                                 "the model, produced it"):
        trainer.fit()
    finding = trainer.callbacks[0].report.findings[0]
    assert (finding.kind, finding.module, finding.batch_idx) == ("loss", "model", 2)


def test_a_non_finite_batch_is_blamed_on_the_batch(tmp_path: Path) -> None:
    class BadData(ToyTrainer):
        def configure_dataloaders(self) -> Any:
            train, val = super().configure_dataloaders()
            train.dataset.tensors[0][3 * 8 + 2, 1] = math.inf  # a sample of batch 3
            return train, val

    trainer = BadData(toy_config(callbacks=[NanGuard(output_dir=tmp_path)]))
    with pytest.raises(FloatingPointError, match="rank 0, batch 3: the batch itself holds "
                                                 "inf, before any module ran"):
        trainer.fit()
    assert trainer.callbacks[0].report.findings[0].kind == "batch"


def test_a_re_run_that_raises_is_reported_and_still_restores(tmp_path: Path) -> None:
    class Flaky(NanLoss):
        """Its training_step fails when it sees the NaN batch a second time."""

        def training_step(self, batch: Any, batch_idx: int) -> dict[str, Any]:
            if self.global_step == self.nan_step:
                self.seen = getattr(self, "seen", 0) + 1
                if self.seen == 2:
                    raise RuntimeError("not twice\nsecond line")
            return super().training_step(batch, batch_idx)

    state = TrainingState(2)
    trainer = Flaky(toy_config(callbacks=[state, NanGuard(output_dir=tmp_path)]))
    trainer.nan_step = 2
    with pytest.raises(FloatingPointError, match=r"non-finite values at global step 2 \(epoch "
                                                 r"0\), on no rank when re-run:\n  rank 0, "
                                                 r"batch 2: the re-run raised RuntimeError: "
                                                 r"not twice\n"):
        trainer.fit()
    assert state.before is not None and state.after is not None
    assert_same_state(state.before, state.after)


def test_a_value_from_an_unchecked_step_is_named_without_a_re_run(tmp_path: Path) -> None:
    # Checked every 3 steps: step 4's NaN is found at step 5's check, its window long gone.
    trainer = NanLoss(toy_config(callbacks=[NanGuard(check_every_n_steps=3,
                                                     output_dir=tmp_path)]))
    trainer.nan_step = 4
    with pytest.raises(FloatingPointError, match=r"loss=nan, grad_norm=nan at global step 4, "
                                                 r"checked at step 5: that window is gone"):
        trainer.fit()
    finding = trainer.callbacks[0].report.findings[0]
    assert (finding.kind, finding.step, finding.batch_idx, finding.batch_file) == \
        ("value", 4, 4, None)
    assert trainer.global_step == 5
    assert not any(tmp_path.iterdir())


def test_skip_mode_diagnoses_and_keeps_training(tmp_path: Path,
                                                caplog: pytest.LogCaptureFixture) -> None:
    guard = NanGuard(mode="skip", output_dir=tmp_path)
    trainer = ProvenanceTrainer(toy_config(callbacks=[guard]))
    trainer.bad_batch = 6
    with caplog.at_level(logging.WARNING, logger="dream_trainer.callbacks.nan_guard"):
        trainer.fit()
    assert trainer.global_step == 20 and guard.skipped_steps == 1
    assert guard.report is not None and guard.report.findings[0].module == "model.1.1"
    assert "skipped this optimizer step (1 skipped so far)\nnon-finite values at global " \
           "step 6" in caplog.text
    assert "model.1.1 (Boom) made inf in forward" in caplog.text


def test_the_re_run_replays_the_same_dropout() -> None:
    class Rerun(Callback):
        """Re-runs each step's micro-batch from pre_optimizer_step, as NanGuard does."""

        def __init__(self) -> None:
            self.pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
            self.rerun: torch.Tensor | None = None

        def pre_train_batch(self, batch: Any, batch_idx: int) -> None:
            self.micro = MicroBatch.capture(batch, batch_idx, torch.device("cpu"))

        def pre_optimizer_step(self, model: Any, optimizer: Any) -> None:
            grads = [p.grad for p in model.parameters()]
            after = torch.get_rng_state()
            self.micro.restore_rng(torch.device("cpu"))
            self.rerun = self.trainer.rerun_training_step(self.micro.batch,
                                                          self.micro.batch_idx)["loss"]
            torch.set_rng_state(after)
            for param, grad in zip(model.parameters(), grads, strict=True):
                param.grad = grad

        def post_train_batch(self, result: dict[str, Any], batch_idx: int) -> None:
            assert self.rerun is not None
            self.pairs.append((result["loss"].detach(), self.rerun.detach()))

    rerun = Rerun()
    trainer = ProvenanceTrainer(toy_config(callbacks=[rerun], max_steps=4))
    trainer.fit()
    assert len(rerun.pairs) == 4
    for first, again in rerun.pairs:
        assert torch.equal(first, again)


def test_rerun_training_step_refuses_batches_outside_the_window() -> None:
    class Outside(Callback):
        def pre_optimizer_step(self, model: Any, optimizer: Any) -> None:
            self.trainer.rerun_training_step(None, self.trainer.local_batches - 2)

    trainer = ProvenanceTrainer(toy_config(callbacks=[Outside()],
                                           gradient_accumulation_steps=2))
    with pytest.raises(ValueError, match=r"rerun_training_step\(batch_idx=-1\): the current "
                                         r"window holds batches 0-1"):
        trainer.fit()


def test_arguments_and_unsupported_layouts() -> None:
    with pytest.raises(ValueError, match="diagnose"):
        NanGuard(diagnose="yes")  # type: ignore[arg-type]
    with pytest.raises(RuntimeError, match="FSDP2 model cannot run forward or backward on "
                                           "one rank alone"):
        FSDPBackend().local_pass(torch.nn.Linear(1, 1))
    guard = NanGuard()
    guard.trainer = ProvenanceTrainer(toy_config())
    assert guard._why_not_diagnosed() is None
    guard.trainer.world.dims = ParallelDims(pp=1, dp_replicate=1, dp_shard=2, cp=1, tp=1)
    assert "dp_shard=2 every forward and backward is collective" in guard._why_not_diagnosed()
    float16 = NanGuard()
    float16.trainer = ProvenanceTrainer(toy_config(
        device_parameters=DeviceParameters(param_dtype="float16")))
    float16.pre_launch()
    assert "float16" in float16._why_not_diagnosed()


def test_ddp_local_pass_switches_off_sync_and_puts_the_flags_back() -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0,
                            world_size=1)
    try:
        model = DistributedDataParallel(torch.nn.BatchNorm1d(2))
        model(torch.randn(4, 2)).sum().backward()
        flags = ("require_backward_grad_sync", "require_forward_param_sync")
        before = [getattr(model, flag) for flag in flags]
        assert before == [True, True]
        with DDPBackend().local_pass(model):
            assert [getattr(model, flag) for flag in flags] == [False, False]
            model(torch.randn(4, 2)).sum().backward()
        assert [getattr(model, flag) for flag in flags] == before
    finally:
        dist.destroy_process_group()


def test_two_ranks_name_the_rank_and_the_layer(tmp_path: Path) -> None:
    # One launch, two runs; only rank 1 has the bad micro-batch. Forward at the very first
    # optimizer step (DDP's bucket rebuild is still due), backward at step 2.
    check(torchrun(REPO / "tests/scripts/nan_provenance_run.py", [str(tmp_path)], timeout=180))
    for rank in (0, 1):
        runs = torch.load(tmp_path / f"rank{rank}.pt", weights_only=True)
        forward, backward = runs["forward"], runs["backward"]
        assert forward["ranks"] == [1] and backward["ranks"] == [1], rank
        assert forward["culprit"] == {"rank": 1, "kind": "forward", "module": "model.1.1",
                                      "step": 0, "batch_idx": 1}
        assert backward["culprit"] == {"rank": 1, "kind": "backward", "module": "model.1.1",
                                       "step": 2, "batch_idx": 5}
        assert forward["others"] == backward["others"] == [(0, "finite")]
        assert "global step 0 (batch 1 of epoch 0) on rank 1:" in forward["message"]
        assert "\n  rank 0: the re-run of its batches 0-1 stayed finite" in forward["message"]
        # Both ranks stopped at the step that went wrong, before its update.
        assert (forward["global_step"], backward["global_step"]) == (0, 2)
    runs = torch.load(tmp_path / "rank1.pt", weights_only=True)
    saved = torch.load(runs["forward"]["batch_file"], weights_only=True)
    assert saved["rank"] == 1 and saved["batch_idx"] == 1
    for tensor, trained in zip(saved["batch"], runs["forward"]["trained_batch"], strict=True):
        assert torch.equal(tensor, trained)
