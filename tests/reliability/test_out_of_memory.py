"""An out-of-memory error ends every rank with a message that names where it happened, the
memory held and the settings that lower it; the newest checkpoint stays as it was."""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path
from typing import Any

import pytest
import torch

from dream_trainer.configs import DeviceParameters, LoggingParameters, TrainingParameters
from dream_trainer.trainer.out_of_memory import (MemoryUse, explain, failing_phase, format_bytes,
                                                 is_out_of_memory, memory_use, remedies)
from dream_trainer.world.dims import ParallelDims
from tests.helpers.launch import REPO, outputs_of, spawn_ranks
from tests.helpers.toy import LoggedToyConfig, RecordingLogger, ToyTrainer, toy_config

SCRIPT = REPO / "tests/scripts/out_of_memory_run.py"
PLANNER = ("planner estimate: not estimated (the planner runs a step of its own); run "
           "`dream-trainer plan <module:Trainer> --world-size <N> --device-memory <SIZE> "
           "--activation-policies` for this layout's memory per rank and per checkpointing "
           "policy")
HOST_MEMORY = re.compile(r"memory resident in this process's host memory: [0-9.]+ [KMG]iB in "
                         r"use, peak [0-9.]+ [KMG]iB")
TRAIN_REMEDIES = ("device_parameters.activation_checkpointing='selective' (recomputes "
                  "activations in backward instead of keeping them); "
                  "device_parameters.activation_offload=True (moves what the blocks save for "
                  "backward to host memory until backward); "
                  "training_parameters.train_batch_size=2 with gradient_accumulation_steps=2 "
                  "(the same global batch when 4 is even, in smaller micro-batches); ")
# Two ranks of DDP: dp_replicate resolved to 2.
MORE_SHARDS = ("device_parameters.dp_shard=2 with dp_replicate=1 (shards parameters, gradients "
               "and optimizer state over the replicas too)")
# What rank 1's message says per phase: (where, the injected error, the settings line).
EXPECTED = {
    "forward": ("epoch 0, global step 2, batch 2", "injected in forward",
                TRAIN_REMEDIES + MORE_SHARDS),
    "backward": ("epoch 0, global step 2, batch 2", "injected in backward",
                 TRAIN_REMEDIES + MORE_SHARDS),
    "optimizer": ("epoch 0, global step 2, batch 2", "injected in the optimizer step",
                  MORE_SHARDS),
    "validation": ("epoch 0, global step 3", "injected in validation",
                   "training_parameters.val_batch_size=2"),
}
# Bounded by the failure test of test_process_faults (60 s a launch); measured 0.5 s.
FAILURE_SECONDS = 30


@pytest.mark.distributed
@pytest.mark.parametrize("phase", list(EXPECTED))
def test_out_of_memory_on_one_rank_ends_both_with_the_explanation(phase: str,
                                                                  tmp_path: Path) -> None:
    procs = spawn_ranks(SCRIPT, [str(tmp_path), phase])
    outputs = outputs_of(procs, timeout=120)
    failed, peer = (json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in (1, 0))
    where, injected, settings = EXPECTED[phase]
    error = f"OutOfMemoryError: CUDA out of memory ({injected})"
    assert failed["error"] == error, outputs
    message = failed["messages"][0].split("\n  ")
    assert len(failed["messages"]) == 1
    assert message[0] == f"fit() failed on rank 1 of 2 ({where}): {error}"
    assert message[1] == (f"out of memory on rank 1 of 2 ({where}), in the {phase} phase "
                          "(OutOfMemoryError)")
    assert HOST_MEMORY.fullmatch(message[2]), message[2]
    assert message[3] == PLANNER
    assert message[4] == "settings that lower it, cheapest first: " + settings
    assert len(message) == 5
    # The peer does not wait for a collective timeout: it fails as soon as rank 1 is gone.
    assert peer["error"] != "none" and peer["messages"][0].startswith("fit() failed on rank 0 "
                                                                      "of 2")
    for rank in (failed, peer):
        assert rank["ended"] - failed["injected_at"] < FAILURE_SECONDS
    # The checkpoint of step 2 is complete, nothing was added or changed after it.
    names = {Path(name).parts[-2] for name, _, _ in failed["before"]}
    assert "step_2" in names and "step_4" not in names
    assert failed["after"] == failed["before"]
    assert peer["after"] == failed["before"]


class AllocatesTooMuch(ToyTrainer):
    def training_step(self, batch: Any, batch_idx: int) -> dict[str, Any]:
        if self.global_step == 1:
            torch.empty(2**50, dtype=torch.uint8)  # more than any address space: refused
        return super().training_step(batch, batch_idx)


def test_the_cpu_allocators_failure_is_explained(caplog: pytest.LogCaptureFixture) -> None:
    trainer = AllocatesTooMuch(toy_config(train_batch_size=8, gradient_accumulation_steps=2))
    with caplog.at_level(logging.ERROR, logger="dream_trainer.trainer.base"):
        with pytest.raises(RuntimeError, match="DefaultCPUAllocator: can't allocate memory"):
            trainer.fit()
    lines = caplog.records[-1].getMessage().split("\n  ")
    assert lines[1] == ("out of memory on rank 0 of 1 (epoch 0, global step 1, batch 2), in the "
                        "forward phase (RuntimeError)")
    assert HOST_MEMORY.fullmatch(lines[2]), lines[2]
    assert lines[4] == (
        "settings that lower it, cheapest first: device_parameters.activation_checkpointing="
        "'selective' (recomputes activations in backward instead of keeping them); "
        "device_parameters.activation_offload=True (moves what the blocks save for backward "
        "to host memory until backward); training_parameters.train_batch_size=4 with gradient_accumulation_steps=4 (the same "
        "global batch when 8 is even, in smaller micro-batches); more ranks with a larger "
        "dp_shard (dp_shard=2 on 2 ranks halves each rank's share of the sharded state)")


def test_other_failures_keep_their_one_line_message(caplog: pytest.LogCaptureFixture) -> None:
    class Fails(ToyTrainer):
        def training_step(self, batch: Any, batch_idx: int) -> dict[str, Any]:
            raise RuntimeError("not a memory problem")

    with caplog.at_level(logging.ERROR, logger="dream_trainer.trainer.base"):
        with pytest.raises(RuntimeError, match="not a memory problem"):
            Fails(toy_config()).fit()
    assert caplog.records[-1].getMessage() == ("fit() failed on rank 0 of 1 (epoch 0, global "
                                               "step 0, batch 0): RuntimeError: not a memory "
                                               "problem")


@pytest.mark.parametrize(("exc", "expected"), [
    (torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"), True),
    (MemoryError(), True),
    (RuntimeError("[enforce fail at alloc_cpu.cpp:127] DefaultCPUAllocator: can't allocate "
                  "memory: you tried to allocate 10 bytes"), True),
    (RuntimeError("CUDA out of memory. Tried to allocate 20.00 MiB"), True),
    (RuntimeError("shape mismatch"), False),
    (ValueError("CUDA out of memory"), False),
])
def test_allocation_failures_are_recognized(exc: BaseException, expected: bool) -> None:
    assert is_out_of_memory(exc) is expected


def _raised_in(module: str) -> BaseException:
    """An error raised from a function whose frame belongs to ``module``."""
    namespace: dict[str, Any] = {"__name__": module}
    exec("def save():\n    raise torch.OutOfMemoryError('x')\n", {**namespace, "torch": torch},
         namespace)
    try:
        namespace["save"]()
    except torch.OutOfMemoryError as exc:
        return exc
    raise AssertionError("save() did not raise")


def test_the_phase_is_the_innermost_marked_frame() -> None:
    saving = _raised_in("torch.distributed.checkpoint.state_dict_saver")
    assert failing_phase(saving.__traceback__) == "checkpoint"
    assert failing_phase(_raised_in("dream_trainer.checkpoint.storage").__traceback__) \
        == "checkpoint"
    assert failing_phase(_raised_in("torch.optim.adamw").__traceback__) == "optimizer"
    # A module whose name only starts like a marked one marks nothing.
    assert failing_phase(_raised_in("torch.optimistic").__traceback__) is None
    assert failing_phase(_raised_in("my_project.setup").__traceback__) is None
    assert failing_phase(None) is None


def test_backward_is_recognized_inside_torchs_engine() -> None:
    x = torch.ones(3, requires_grad=True)
    y = x * 2

    def fail(grad: torch.Tensor) -> torch.Tensor:
        raise torch.OutOfMemoryError("in a backward hook")

    y.register_hook(fail)
    with pytest.raises(torch.OutOfMemoryError) as info:
        y.sum().backward()
    assert failing_phase(info.value.__traceback__) == "backward"


def _training(**fields: Any) -> TrainingParameters:
    return TrainingParameters(**{"n_epochs": 1, "train_batch_size": 8, **fields})


@pytest.mark.parametrize(("policy", "stronger"), [
    (None, "'selective'"), ("selective", "2"), (8, "4"), (3, "'full'"), (2, "'full'"),
])
def test_checkpointing_is_suggested_one_policy_stronger(policy: Any, stronger: str) -> None:
    device = DeviceParameters(activation_checkpointing=policy)
    found = remedies("backward", device, _training(), ParallelDims.resolve(device, 1))
    assert found[0] == (f"device_parameters.activation_checkpointing={stronger} (recomputes "
                        "activations in backward instead of keeping them)")


def test_full_checkpointing_offloaded_and_a_batch_of_one_leave_only_more_ranks() -> None:
    device = DeviceParameters(dp_replicate=1, dp_shard=4, activation_checkpointing="full",
                              activation_offload=True)
    found = remedies("forward", device, _training(train_batch_size=1),
                     ParallelDims.resolve(device, 4))
    assert found == ["more ranks with a larger dp_shard (dp_shard=8 on 8 ranks halves each "
                     "rank's share of the sharded state)"]


def test_offload_is_suggested_only_where_the_config_allows_it() -> None:
    dims = ParallelDims.resolve(DeviceParameters(), 1)
    offload = ("device_parameters.activation_offload=True (moves what the blocks save for "
               "backward to host memory until backward)")
    assert offload in remedies("forward", DeviceParameters(activation_checkpointing="full"),
                               _training(), dims)
    for refused in (DeviceParameters(activation_checkpointing="selective"),
                    DeviceParameters(compile_model=True)):
        assert offload not in remedies("forward", refused, _training(), dims)


def test_replicas_are_suggested_as_shards_and_offload_for_the_optimizer() -> None:
    device = DeviceParameters(dp_replicate=2, dp_shard=4, activation_checkpointing="full")
    assert remedies("optimizer", device, _training(), ParallelDims.resolve(device, 8)) == [
        "device_parameters.dp_shard=8 with dp_replicate=1 (shards parameters, gradients and "
        "optimizer state over the replicas too)",
        "device_parameters.cpu_offload=True (FSDP2 keeps parameters, gradients and optimizer "
        "state in host memory)",
    ]
    offloaded = DeviceParameters(dp_replicate=1, dp_shard=2, cpu_offload=True)
    assert remedies("optimizer", offloaded, _training(), ParallelDims.resolve(offloaded, 2)) \
        == ["more ranks with a larger dp_shard (dp_shard=4 on 4 ranks halves each rank's share "
            "of the sharded state)"]
    # One shard: FSDP2, and so its offload, does not apply.
    single = DeviceParameters(dp_replicate=1)
    assert remedies("optimizer", single, _training(), ParallelDims.resolve(single, 1)) \
        == ["more ranks with a larger dp_shard (dp_shard=2 on 2 ranks halves each rank's share "
            "of the sharded state)"]


def test_validation_suggests_a_smaller_validation_batch() -> None:
    dims = ParallelDims.resolve(DeviceParameters(), 1)
    assert remedies("validation", DeviceParameters(), _training(val_batch_size=6), dims) \
        == ["training_parameters.val_batch_size=3"]
    assert remedies("validation", DeviceParameters(), _training(val_batch_size=1), dims) == []


def test_the_message_names_every_part() -> None:
    memory = MemoryUse("allocated by tensors on cuda:0", 70 * 2**30, 79 * 2**30 + 2**29)
    text = explain(torch.OutOfMemoryError("x"), "optimizer", "rank 3 of 8 (epoch 1, global "
                   "step 40, batch 7)", memory, ["a", "b"])
    assert text.split("\n  ") == [
        "out of memory on rank 3 of 8 (epoch 1, global step 40, batch 7), in the optimizer "
        "phase (OutOfMemoryError)",
        "memory allocated by tensors on cuda:0: 70 GiB in use, peak 79.5 GiB",
        PLANNER,
        "settings that lower it, cheapest first: a; b",
    ]
    outside = explain(MemoryError(), None, "rank 0 of 1 (epoch 0, global step 0)",
                      MemoryUse("resident", None, 2048), [])
    assert outside.split("\n  ")[:2] == [
        "out of memory on rank 0 of 1 (epoch 0, global step 0), outside a training step "
        "(MemoryError)",
        "memory resident: unknown in use, peak 2 KiB"]


def test_host_memory_is_the_process_resident_set() -> None:
    held = torch.ones(64 * 2**20, dtype=torch.uint8)  # 64 MiB, touched so it is resident
    use = memory_use(torch.device("cpu"))
    assert use.in_use is not None and use.peak is not None
    assert held.nbytes <= use.in_use <= use.peak
    assert format_bytes(1536) == "1.5 KiB" and format_bytes(100) == "100 B"


class LoggedRunsOutOfMemory(ToyTrainer, RecordingLogger):
    def training_step(self, batch: Any, batch_idx: int) -> dict[str, Any]:
        if self.global_step == 1:
            raise torch.OutOfMemoryError("CUDA out of memory (injected)")
        return super().training_step(batch, batch_idx)


def _snapshot_config(root: Path, device: str) -> Any:
    return LoggedToyConfig(**dict(toy_config(device_parameters=DeviceParameters(device=device))),
                           logging_parameters=LoggingParameters(
                               enabled=False, log_dir=root, memory_snapshot_on_oom=True))


def test_a_snapshot_asked_for_off_cuda_is_a_warning_and_writes_nothing(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    trainer = LoggedRunsOutOfMemory(_snapshot_config(tmp_path, "cpu"))
    with caplog.at_level(logging.WARNING, logger="dream_trainer.mixins.logging"):
        with pytest.raises(torch.OutOfMemoryError):
            trainer.fit()
    warnings = [record.getMessage() for record in caplog.records
                if record.name == "dream_trainer.mixins.logging"]
    assert warnings == ["logging_parameters.memory_snapshot_on_oom=True, but this run is on cpu "
                        "and only CUDA records allocation history: no snapshot will be written "
                        "(set it False off CUDA)"]
    assert list(tmp_path.rglob("*")) == []
    with pytest.raises(ValueError, match="memory_snapshot_on_oom"):
        LoggingParameters(memory_snapshot_on_oom="sometimes")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the allocator history is CUDA's")
def test_on_cuda_the_snapshot_is_written_beside_the_logs(tmp_path: Path) -> None:
    import pickle

    trainer = LoggedRunsOutOfMemory(_snapshot_config(tmp_path, "cuda"))
    with pytest.raises(torch.OutOfMemoryError):
        trainer.fit()
    path = trainer.log_dir / "memory_snapshot_rank0.pickle"
    snapshot = pickle.loads(path.read_bytes())
    assert snapshot["segments"] and snapshot["device_traces"][0]  # the run's allocations
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no partial dump is left


def test_a_failing_explanation_never_hides_the_error(monkeypatch: pytest.MonkeyPatch) -> None:
    from dream_trainer.trainer import out_of_memory

    def broken(device: torch.device) -> MemoryUse:
        raise OSError("no /proc here")

    monkeypatch.setattr(out_of_memory, "memory_use", broken)
    trainer = ToyTrainer(toy_config())
    note = out_of_memory.failure_note(MemoryError(), "rank 0 of 1 (epoch 0, global step 0)",
                                      trainer.world, trainer.config)
    assert note == "\n  (out of memory; explaining it failed: OSError: no /proc here)"
    assert out_of_memory.failure_note(ValueError("x"), "", trainer.world, trainer.config) == ""
