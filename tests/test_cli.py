"""The command line: help, summarize, benchmark, profile, bad targets, and export of a checkpoint.

Commands run in this process through ``main([...])`` (each tears its one-process world down);
only the torchrun run needs child processes.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from dream_trainer.cli import main
from tests.helpers.checkpointing import CheckpointedTrainer, checkpointed_config
from tests.helpers.launch import REPO, check, child_env
from tests.scripts.cli_trainer import PARAMETERS

SCRIPT = REPO / "tests" / "scripts" / "cli_trainer.py"
TARGET = f"{SCRIPT}:make_trainer"
GRAPH_BREAKS = REPO / "tests" / "scripts" / "graph_break_trainer.py"


pytestmark = pytest.mark.usefixtures("restore_imports")


def sandboxes(directory: Path) -> set[Path]:
    return set(directory.glob("dream-trainer-*"))


@pytest.mark.parametrize(("command", "expected"), [
    ([], ["summarize", "benchmark", "profile", "find-graph-breaks", "export", "TARGET"]),
    (["summarize"], ["TARGET", "OVERRIDE", "--depth"]),
    (["benchmark"], ["TARGET", "OVERRIDE", "--steps", "--warmup", "--json"]),
    (["profile"], ["TARGET", "OVERRIDE", "--steps", "--warmup", "--out"]),
    (["find-graph-breaks"], ["TARGET", "OVERRIDE", "torch._dynamo.explain"]),
    (["export"], ["checkpoint", "out_dir", "safetensors"]),
])
def test_help_names_the_commands_and_their_options(
        command: list[str], expected: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main([*command, "--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    for word in expected:
        assert word in out, (word, out)


def test_find_graph_breaks_names_each_blocks_break_and_its_reason(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, private_tempdir: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    from tests.scripts.graph_break_trainer import BREAK_LINE

    monkeypatch.chdir(tmp_path)
    assert main(["find-graph-breaks", f"{GRAPH_BREAKS}:make_trainer"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "model.blocks.0 (Block): 2 graphs, 1 graph break"
    assert lines[1] == f"  1. {GRAPH_BREAKS}:{BREAK_LINE} in forward"
    assert lines[2:4] == ["    torch._dynamo.graph_break()",
                          "    Call to `torch._dynamo.graph_break()`"]
    # The second block breaks the same way: listed once, not repeated.
    assert "model.blocks.1 (Block): 2 graphs, 1 graph break, the same as model.blocks.0" in lines
    assert lines[-1] == "2 blocks explained, 2 graph breaks in all"
    assert sandboxes(private_tempdir) == set() and not (tmp_path / "outputs").exists()


def test_summarize_prints_the_config_world_and_models_without_training(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)  # the script's checkpoints and logs would default to ./outputs
    assert main(["summarize", TARGET, "--learning_rate", "0.5"]) == 0
    out = capsys.readouterr().out
    config = json.loads(out.split("== config (CliConfig) ==\n")[1].split("== world ==")[0])
    assert config["learning_rate"] == 0.5  # the override reached the factory
    assert config["training_parameters"]["train_batch_size"] == 8
    assert config["project"] == "cli"
    assert "world size 1, device cpu, backend gloo" in out
    assert "mesh: none" in out
    assert f"model: plain, float32, {PARAMETERS} parameters ({PARAMETERS} trainable)" in out
    assert f"optimizer: AdamW, 1 param group, {PARAMETERS} parameters, lr 0.5" in out
    assert "train: 8 batches of 8 per rank per epoch" in out
    assert "val: 2 batches of 8 per rank per pass" in out
    assert "ran the script's __main__ block" not in out
    assert list(tmp_path.iterdir()) == []


def test_summarize_shows_the_configured_learning_rate_not_the_warmups_first(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    # A linear warmup from 0: the optimizer's lr is 0 until the first step.
    assert main(["summarize", TARGET, "--learning_rate", "0.5", "--warmup_steps", "4"]) == 0
    out = capsys.readouterr().out
    assert (f"optimizer: AdamW, 1 param group, {PARAMETERS} parameters, lr 0.5 (configured; "
            "the scheduler starts at 0)\nscheduler: LambdaLR on optimizer\n") in out


def test_benchmark_measures_n_steps_and_writes_nothing_into_the_run_directories(
        tmp_path: Path, private_tempdir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    figures = tmp_path / "figures.json"
    # 16 samples are 2 steps per epoch: the 5 steps asked for need more epochs than the 2
    # configured, each saving a checkpoint in the user's config.
    assert main(["benchmark", TARGET, "--checkpoint_parameters.root_dir", str(tmp_path / "ckpt"),
                 "--steps", "4", "--warmup", "1", "--json", str(figures),
                 "--", "--logging_parameters.log_dir", str(tmp_path / "logs"),
                 "--samples", "16"]) == 0
    out = capsys.readouterr().out
    assert "steps: 4 measured after 1 warm-up steps" in out
    assert "samples/s:" in out and "steps/s:" in out
    written = json.loads(figures.read_text())
    assert written["steps"] == 4 and len(written["step_times_s"]) == 4
    assert written["samples_per_step"] == 8
    assert written["samples_per_second"] == pytest.approx(8 * 4 / sum(written["step_times_s"]))
    assert sorted(path.name for path in tmp_path.iterdir()) == ["figures.json"]
    assert sandboxes(private_tempdir) == set()  # the temporary checkpoint directory is gone too


def test_profile_writes_a_chrome_trace_and_prints_the_top_operators(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out_dir = tmp_path / "profile"
    assert main(["profile", TARGET, "--steps", "2", "--warmup", "1", "--out", str(out_dir)]) == 0
    out = capsys.readouterr().out
    trace = json.loads((out_dir / "trace_rank0.json").read_text())
    assert trace["traceEvents"]
    assert "Self CPU" in out and "aten::addmm" in out
    assert f"trace: {out_dir / 'trace_rank0.json'}" in out


@pytest.mark.parametrize(("target", "message"), [
    ("tests/scripts/missing.py:make_trainer", "no such file: tests/scripts/missing.py"),
    (f"{SCRIPT}:make_trainr", "has no attribute 'make_trainr'"),
    (f"{SCRIPT}:NOT_CALLABLE", "NOT_CALLABLE is not callable (type int)"),
    (f"{SCRIPT}:make_something_else", "make_something_else() returned dict, not a trainer"),
    (f"{SCRIPT}:CliTrainer", "CliTrainer is a trainer class, not a factory"),
    (str(SCRIPT), "names no factory"),
    ("tests.scripts.no_such_module:make_trainer", "no module named 'tests.scripts.no_such_module'"),
])
def test_a_bad_target_is_a_one_line_error_with_exit_code_2(
        target: str, message: str, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(REPO)
    assert main(["summarize", target]) == 2
    err = capsys.readouterr().err
    assert err.startswith("dream-trainer summarize: error: ") and err.count("\n") == 1, err
    assert message in err
    assert "path/to/script.py:NAME or package.module:NAME" in err


def test_a_module_target_and_a_factory_without_arguments(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(REPO)
    assert main(["summarize", "tests.scripts.cli_trainer:make_trainer_without_args",
                 "--depth", "0"]) == 0
    assert f"{PARAMETERS} parameters" in capsys.readouterr().out
    # Overrides for a factory that cannot take them are refused, not dropped.
    assert main(["summarize", "tests.scripts.cli_trainer:make_trainer_without_args",
                 "--hidden", "3"]) == 2
    assert "make_trainer_without_args() takes no arguments" in capsys.readouterr().err


def test_a_bad_override_is_pydantics_error_naming_the_field(
        capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["summarize", TARGET, "--training_parameters.n_epochs", "0"]) == 2
    err = capsys.readouterr().err
    assert "training_parameters.n_epochs" in err and "greater than 0" in err
    with pytest.raises(SystemExit) as exit_:
        main(["summarize", TARGET, "--training_parameters.n_epoch", "3"])
    assert exit_.value.code == 2
    assert "cli_trainer.py: error: unrecognized arguments: --training_parameters.n_epoch 3" \
        in capsys.readouterr().err


@pytest.mark.distributed
def test_benchmark_under_torchrun_prints_once(tmp_path: Path) -> None:
    figures = tmp_path / "figures.json"
    result = check(subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
         "-m", "dream_trainer", "benchmark", TARGET, "--steps", "3", "--warmup", "1",
         "--json", str(figures)],
        env=child_env(), cwd=tmp_path, capture_output=True, text=True, timeout=240))
    assert result.stdout.count("steps: 3 measured") == 1, result.stdout
    assert "(world size 2, device cpu)" in result.stdout
    written = json.loads(figures.read_text())
    assert (written["dp_size"], written["samples_per_step"]) == (2, 16)
    assert sorted(path.name for path in tmp_path.iterdir()) == ["figures.json"]


@pytest.mark.distributed
def test_summarize_shows_each_pipeline_stage(tmp_path: Path) -> None:
    # The script's config leaves the data-parallel degrees at their defaults: on 2 ranks a
    # 2-stage pipeline takes both, and the "auto" replicas resolve to 1.
    result = check(subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
         "-m", "dream_trainer", "summarize", TARGET, "--device_parameters.pipeline_parallel",
         "2"], env=child_env(), cwd=tmp_path, capture_output=True, text=True, timeout=240))
    out = result.stdout
    assert out.count("== world ==") == 1, out  # printed by rank 0 only
    assert "mesh: pp=2" in out
    assert f"model: pipeline of 2 stages (plain within each), float32, {PARAMETERS} parameters" \
        in out
    assert "model pipeline: 1F1B, 2 microbatches per batch" in out
    # Linear(8, 16) with the Tanh after it, then Linear(16, 4): 144 and 68 parameters.
    assert "stage 0 on pipeline rank 0: 0, 1 (144 parameters)" in out
    assert "stage 1 on pipeline rank 1: 2 (68 parameters)" in out
    assert "pipeline_schedule" in out and "pipeline_microbatches" in out  # TrainerSummary


@pytest.mark.distributed
def test_summarize_shows_the_context_parallel_layout(tmp_path: Path) -> None:
    # The data-parallel degrees at their defaults: cp=2 takes both ranks, and FSDP2 shards
    # the weights over the cp ranks (dp_shard x cp) although there is no data parallelism.
    result = check(subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
         "-m", "dream_trainer", "summarize", TARGET, "--device_parameters.context_parallel",
         "2"], env=child_env(), cwd=tmp_path, capture_output=True, text=True, timeout=240))
    out = result.stdout
    assert out.count("== world ==") == 1, out
    assert "mesh: cp=2; data parallel: none\n" in out
    assert ("context parallel: each sequence split over 2 ranks along dim 1 into 4 chunks "
            "(load balanced: rank r holds chunks r and 3-r); FSDP2 shards the weights over "
            "dp_shard x cp = 2 ranks") in out
    assert f"model: FSDP2, float32, {PARAMETERS} parameters" in out
    rows = {line.split()[1]: line.split()[3] for line in out.splitlines()
            if line.startswith("│ context_parallel")}
    assert rows == {"context_parallel": "2", "context_parallel_seq_dim": "1",
                    "context_parallel_load_balance": "True"}


def test_the_context_parallel_line_names_each_ranks_chunks() -> None:
    from dream_trainer.cli.summarize import _context
    from dream_trainer.configs import DeviceParameters
    from dream_trainer.world.dims import ParallelDims

    dims = ParallelDims(pp=1, dp_replicate=1, dp_shard=2, cp=4, tp=1)
    device = DeviceParameters(dp_shard=2, context_parallel=4, context_parallel_seq_dim=2,
                              context_parallel_load_balance=False)
    assert _context(dims, device) == (
        "context parallel: each sequence split over 4 ranks along dim 2 into 4 chunks "
        "(contiguous: rank r holds chunk r); FSDP2 shards the weights over dp_shard x cp = 8 "
        "ranks")
    balanced = device.model_copy(update={"context_parallel_load_balance": True})
    assert "into 8 chunks (load balanced: rank r holds chunks r and 7-r)" in \
        _context(dims, balanced)


def test_export_command_writes_loadable_weights(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trainer = CheckpointedTrainer(checkpointed_config(tmp_path, resume=None))
    trainer.fit()
    capsys.readouterr()
    checkpoint = tmp_path / "ckpt/tests/run/checkpoints" / f"step_{trainer.global_step}"
    assert main(["export", str(checkpoint), str(tmp_path / "out")]) == 0
    assert f"model: {tmp_path / 'out' / 'model.safetensors'}" in capsys.readouterr().out
    weights = load_file(tmp_path / "out" / "model.safetensors")
    for name, tensor in trainer.model.state_dict().items():
        assert torch.equal(weights[name], tensor)


def test_export_of_a_broken_checkpoint_fails_with_a_message(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "step_3").mkdir()
    assert main(["export", str(tmp_path / "step_3"), str(tmp_path / "out")]) == 1
    assert "is not a complete dream_trainer checkpoint" in capsys.readouterr().err


def test_export_takes_no_overrides(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["export", "step_3", "out", "--learning_rate", "1"])
    assert exit_.value.code == 2
    assert "unrecognized arguments: --learning_rate 1" in capsys.readouterr().err
