"""``dream-trainer plan`` as a user runs it: JSON, tables, fits, and errors at a size.

Commands run in this process through ``main([...])``: each simulated rank creates its fake
process group and destroys it before the next, so the suite's leak guard sees none.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from pydantic import ValidationError

from dream_trainer.cli import main
from tests.helpers.launch import REPO
from tests.scripts.plan_trainer import BATCH, DIM, HEAD_DIM, SEQ
from tests.scripts.plan_trainer import config as plan_config

SCRIPT = REPO / "tests" / "scripts" / "plan_trainer.py"
TARGET = f"{SCRIPT}:make_trainer"
FSDP_TP = ["--", "--device_parameters",
           '{"dp_replicate": 1, "dp_shard": "auto", "tensor_parallel": 4}']


pytestmark = pytest.mark.usefixtures("restore_imports")


def test_json_has_the_contracts_keys_per_world_size_and_says_whether_it_fits(
        capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", TARGET, "--world-size", "8,64", "--json",
                 "--device-memory", "80GiB", *FSDP_TP]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2
    plans = [json.loads(line) for line in lines]
    assert [plan["world_size"] for plan in plans] == [8, 64]
    assert [plan["mesh"] for plan in plans] == [{"dp_shard": 2, "tp": 4}, {"dp_shard": 16, "tp": 4}]
    for plan in plans:
        assert set(plan) == {"world_size", "mesh", "ranks", "fits"}
        assert plan["fits"] is True
        assert set(plan["ranks"]) == {"0", str(plan["world_size"] - 1)}
        for figures in plan["ranks"].values():
            assert set(figures) == {"param_bytes", "grad_bytes", "optimizer_bytes",
                                    "activation_bytes", "saved_activation_bytes",
                                    "offloaded_activation_bytes", "collectives"}
            # Forward keeps part of the step's peak for backward; nothing is offloaded.
            assert 0 < figures["saved_activation_bytes"] < figures["activation_bytes"]
            assert figures["offloaded_activation_bytes"] == 0
            assert all(type(figures[key]) is int and figures[key] > 0 for key in
                       ("param_bytes", "grad_bytes", "optimizer_bytes", "activation_bytes"))
            assert set(figures["collectives"]) == {"dp_shard", "tp", "dp_shard_tp"}  # norm: flattened
            for traffic in figures["collectives"].values():
                assert set(traffic) == {"count", "bytes"} and traffic["count"] > 0
    # Eight times the FSDP degree: each rank holds far less (padding keeps it above an eighth).
    assert plans[0]["ranks"]["0"]["param_bytes"] > 4 * plans[1]["ranks"]["0"]["param_bytes"]


def test_a_device_too_small_is_reported_with_the_shortfall_and_exit_status_1(
        capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", TARGET, "--world-size", "8", "--rank", "3",
                 "--device-memory", "64KiB"]) == 1
    out = capsys.readouterr().out
    assert ("ranks 3 of each world size simulated on torch's fake backend, one optimizer step "
            "each (1 micro-batch from plan_batch())") in out
    header, row = out.splitlines()[2:4]
    assert header.split()[:3] == ["world", "size", "mesh"] and "fits in 64 KiB" in header
    assert row.split()[:3] == ["8", "dp_shard=8", "128"]  # 2,048 samples / 8 ranks / batch 2
    assert "no, " in row and " short" in row
    assert "Not measured: time, bandwidth" in " ".join(out.split())


def test_heads_not_divisible_by_tp_16_fail_as_the_real_run_would(
        capsys: pytest.CaptureFixture[str]) -> None:
    status = main(["plan", TARGET, "--world-size", "64,1024", "--json", "--", "--device_parameters",
                   '{"dp_replicate": 1, "dp_shard": "auto", "tensor_parallel": 16}'])
    captured = capsys.readouterr()
    assert status == 1 and captured.out == ""  # no figures for a layout that cannot run
    # What one rank's attention raises in eager mode when its q projection holds
    # DIM / 16 columns, fewer than one head.
    with pytest.raises(RuntimeError) as eager:
        torch.zeros(BATCH, SEQ, DIM // 16).view(BATCH, SEQ, -1, HEAD_DIM)
    errors = [line for line in captured.err.splitlines() if line.startswith("dream-trainer")]
    assert errors == [f"dream-trainer plan: world size {size}: rank 0 would fail with "
                      f"RuntimeError: {eager.value}" for size in (64, 1024)]


def test_a_loader_too_small_for_1024_ranks_is_the_error_setup_raises(
        capsys: pytest.CaptureFixture[str]) -> None:
    status = main(["plan", f"{SCRIPT}:make_loader_trainer", "--world-size", "8,1024",
                   "--rank", "-1", "--", "--samples", "64"])
    captured = capsys.readouterr()
    assert status == 1
    assert "(1 micro-batch from the train loader)" in captured.out
    assert ("world size 1024: rank 1023 would fail with ValueError: the train dataloader is "
            "empty (0 batches on this rank)") in captured.err
    assert "world size 8:" not in captured.err
    assert captured.out.splitlines()[3].split()[:3] == ["8", "dp_shard=8", "4"]


def test_ddp_is_refused_with_the_layouts_that_plan_can_simulate(
        capsys: pytest.CaptureFixture[str]) -> None:
    status = main(["plan", TARGET, "--world-size", "8", "--json", "--",
                   "--device_parameters", '{"dp_replicate": "auto", "dp_shard": 1}'])
    assert status == 1
    assert "plan cannot simulate DDP" in capsys.readouterr().err


def test_a_pipeline_plans_its_sends_on_the_pp_axis_and_needs_the_step_api(
        capsys: pytest.CaptureFixture[str]) -> None:
    pipeline = ["--", "--device_parameters", '{"pipeline_parallel": 2, "dp_shard": "auto", '
                '"pipeline_schedule": "1F1B", "pipeline_microbatches": 2}']
    assert main(["plan", f"{SCRIPT}:make_pipeline_trainer", "--world-size", "8", "--json",
                 *pipeline]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["mesh"] == {"pp": 2, "dp_shard": 4}
    activation = BATCH // 2 * SEQ * DIM * 4  # one microbatch's float32 hidden states
    for rank in ("0", "7"):  # the first stage sends activations, the last sends gradients
        assert plan["ranks"][rank]["collectives"]["pp"]["bytes"] >= 4 * activation
    # A training_step that calls the model itself cannot run as a pipeline: the plan says so
    # as the run would.
    assert main(["plan", TARGET, "--world-size", "8", *pipeline]) == 1
    assert "call self.forward_backward(self.model" in capsys.readouterr().err


def test_a_pipelines_batches_that_cannot_be_cut_are_refused_at_setup(
        capsys: pytest.CaptureFixture[str]) -> None:
    # A plan runs setup and one training step, never validation: what it reports, setup
    # raised. 10 validation samples over the 4 data-parallel ranks leave batches of 1.
    pipeline = '{"pipeline_parallel": 2, "dp_shard": "auto", "pipeline_microbatches": 2}'
    assert main(["plan", f"{SCRIPT}:make_pipeline_trainer", "--world-size", "8", "--json", "--",
                 "--device_parameters", pipeline, "--val_samples", "10"]) == 1
    assert ("world size 8: rank 0 would fail with ValueError: the validation loader yields "
            "batches of 1, 2 samples (batch_size=2, 10 samples over 4 data-parallel ranks), and "
            "a pipeline cuts every batch into pipeline_microbatches=2 equal slices, so its "
            "batches of 1 samples cannot run: give the set a multiple of 8 samples") \
        in capsys.readouterr().err
    # pipeline_parallel="auto": the config cannot check the batch size against the
    # microbatches, which setup does once the degree is known, with the config's message.
    with pytest.raises(ValidationError) as fixed:
        plan_config(["--device_parameters", '{"pipeline_parallel": 2}',
                     "--training_parameters.train_batch_size", "3"])
    message = fixed.value.errors()[0]["msg"].removeprefix("Value error, ")
    assert main(["plan", f"{SCRIPT}:make_pipeline_trainer", "--world-size", "2", "--json", "--",
                 "--device_parameters", '{"pipeline_parallel": "auto", "dp_shard": 1}',
                 "--training_parameters.train_batch_size", "3"]) == 1
    assert f"world size 2: rank 0 would fail with ValueError: {message}\n" \
        in capsys.readouterr().err


def test_the_plan_carries_no_torch_warnings(capsys: pytest.CaptureFixture[str]) -> None:
    # DTensor warns of its random ops on a CPU mesh as tensor-parallel weights initialize.
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert main(["plan", TARGET, "--world-size", "8", *FSDP_TP]) == 0
        assert main(["plan", TARGET, "--world-size", "8", "--json", *FSDP_TP]) == 0
    assert [str(warning.message) for warning in caught] == []
    out, err = capsys.readouterr()
    assert "world size  mesh" in out and '"world_size": 8' in out
    assert "Warning" not in out + err


def test_a_pipelined_tied_transformers_decoder_with_checkpoints_plans_on_every_rank(
        capsys: pytest.CaptureFixture[str], tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    # examples/finetune_hf.py: a DreamTrainer (checkpoints on) whose LlamaForCausalLM ties its
    # head to its embedding, split by the default transformers split. Its mask code reads
    # position ids on real tensors; the stage boundaries are sized on fake ones. The last
    # rank plans too: a simulated rank takes no checkpoint lock (which would need rank 0).
    monkeypatch.chdir(tmp_path)  # the example creates its stand-in model under outputs/
    example = f"{REPO / 'examples' / 'finetune_hf.py'}:make_trainer"
    tiny = ["--llama.hidden_size", "32", "--llama.intermediate_size", "64",
            "--llama.num_hidden_layers", "2", "--llama.context", "32",
            "--llama.tie_word_embeddings", "true"]
    # Two validation batches a pass: the set's 151 windows leave each of the 4 data-parallel
    # ranks a short third batch of 5 or 6, which 2 microbatches cannot cut (refused at setup).
    assert main(["plan", example, "--world-size", "8", "--json", "--",
                 "--device_parameters.pipeline_parallel", "2", *tiny,
                 "--training_parameters.val_steps_per_epoch", "2"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["mesh"] == {"pp": 2, "dp_shard": 4}
    hidden = 8 // 2 * 32 * 32 * 4  # one pipeline microbatch's float32 hidden states
    for rank in ("0", "7"):  # 2 microbatches: 2 activations and 2 gradients cross per rank
        assert plan["ranks"][rank]["collectives"]["pp"]["bytes"] >= 4 * hidden
        assert plan["ranks"][rank]["param_bytes"] > 0


@pytest.mark.parametrize(("arguments", "message"), [
    (["--world-size", "8,x"], "is not a comma-separated list of world sizes"),
    (["--world-size", "8", "--device-memory", "80 parsecs"], "is not a memory size"),
])
def test_bad_arguments_name_the_problem(arguments: list[str], message: str,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["plan", TARGET, *arguments])
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err


def test_a_rank_outside_the_world_is_an_error_of_that_size(
        capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", TARGET, "--world-size", "8", "--rank", "8", "--json"]) == 1
    assert "rank 8 is outside a world of 8 ranks" in capsys.readouterr().err


def test_code_that_reads_tensor_values_is_named_as_what_plan_cannot_simulate(
        capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", TARGET, "--world-size", "8", "--json", "--", "--print_loss", "true"]) == 1
    err = capsys.readouterr().err
    assert ("world size 8: rank 0 cannot be planned: the trainer reads a tensor's values "
            "(aten._local_scalar_dense.default: .item()") in err
    assert "skip that code when self.world.simulated is True" in err


def test_a_plan_batch_of_the_wrong_size_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", TARGET, "--world-size", "8", "--", "--plan_rows", "3"]) == 1
    assert ("rank 0 would fail with ValueError: plan_batch() returned a tensor of shape "
            f"(3, {SEQ + 1}), whose first dimension is not train_batch_size={BATCH}") \
        in capsys.readouterr().err


def test_summarize_and_plan_set_the_trainer_up_through_set_up(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    from dream_trainer import BaseTrainer

    calls: list[int] = []
    original = BaseTrainer.set_up

    def counted(self: BaseTrainer, *args: Any, **kwargs: Any) -> None:
        calls.append(self.world.world_size)
        original(self, *args, **kwargs)

    monkeypatch.setattr(BaseTrainer, "set_up", counted)
    monkeypatch.chdir(tmp_path)  # the CLI script's outputs would default to ./outputs
    assert main(["summarize", f"{REPO / 'tests' / 'scripts' / 'cli_trainer.py'}:make_trainer"]) == 0
    assert main(["plan", TARGET, "--world-size", "16", "--json"]) == 0
    capsys.readouterr()
    assert calls == [1, 16, 16]  # summarize's world, then plan's ranks 0 and 15


def test_expert_parallelism_plans_its_all_to_alls_on_the_ep_axis_with_balanced_routing(
        capsys: pytest.CaptureFixture[str]) -> None:
    from tests.scripts.plan_trainer import EXPERTS, TOP_K

    assert main(["plan", f"{SCRIPT}:make_moe_trainer", "--world-size", "8", "--json", "--",
                 "--device_parameters", '{"expert_parallel": 2}']) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["mesh"] == {"efsdp": 4, "ep": 2}  # dp_shard = 8 = efsdp x ep
    slots = BATCH * SEQ * TOP_K  # this rank's routing slots per MoE layer
    per_layer = {
        # the token counts (int64 per expert), then the tokens out and back, in forward and
        # in backward; balanced routing, so every rank sends and receives all of its slots
        "ep": 8 * EXPERTS + 4 * slots * DIM * 4,
        # each rank's 4 experts (3 matrices DIM x 2*DIM) gathered in forward and again in
        # backward, and their gradients reduce-scattered, over the 4 efsdp ranks
        "efsdp": 3 * (EXPERTS // 2) * 3 * DIM * 2 * DIM * 4,
    }
    for rank in ("0", "7"):
        collectives = plan["ranks"][rank]["collectives"]
        for axis, size in per_layer.items():
            assert collectives[axis]["bytes"] == 2 * size, (axis, collectives)  # 2 layers
        assert collectives["ep"]["count"] == 2 * 5 and collectives["efsdp"]["count"] == 2 * 3
    main(["plan", f"{SCRIPT}:make_moe_trainer", "--world-size", "8", "--",
          "--device_parameters", '{"expert_parallel": 2}'])
    assert "are planned with balanced routing" in capsys.readouterr().out.replace("\n", " ")
