"""The examples run end to end and learn what they claim to learn."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.helpers.launch import REPO, check, child_env, torchrun

GAN = REPO / "examples/gan.py"
DIGITS = REPO / "examples/digits.py"
CHAR_GPT = REPO / "examples/char_gpt.py"
FINETUNE = REPO / "examples/finetune.py"

FSDP = ["--device_parameters.dp_replicate", "1", "--device_parameters.dp_shard", "auto"]
# A model and schedule small enough for a few seconds on two CPU ranks; the finetune run
# passes the same shape, since it loads these weights.
TINY_GPT = ["--gpt.dim", "32", "--gpt.n_layers", "2", "--gpt.n_heads", "2", "--gpt.context", "32"]
SHORT_RUN = ["--training_parameters.train_steps_per_epoch", "15",
             "--training_parameters.train_batch_size", "8",
             "--training_parameters.val_steps_per_epoch", "2", "--sample_length", "16"]
PRETRAIN_SCHEDULE = ["--learning_rate", "1e-2", "--warmup_steps", "5"]  # finetune keeps its own
PRETRAIN_EPOCHS, STEPS_PER_EPOCH = 2, 15
CHAR_GPT_FILES = "[a-m]*.py"  # char_gpt.py's default


def generated_means(output: str) -> tuple[float, float]:
    match = re.search(r"generated mean: before=(-?[\d.]+) after=(-?[\d.]+)", output)
    assert match, output
    return float(match.group(1)), float(match.group(2))


def val_losses(output: str) -> list[tuple[int, float]]:
    """The ``step <N>: val_loss=<float>`` lines rank 0 printed, in order."""
    return [(int(step), float(loss))
            for step, loss in re.findall(r"^step (\d+): val_loss=([\d.]+)", output, re.M)]


def printed_path(output: str, what: str) -> Path:
    match = re.search(rf"^{what}: (.+)$", output, re.M)
    assert match, output
    return Path(match.group(1))


def step_dirs(checkpoints: Path) -> set[str]:
    return {path.name for path in checkpoints.iterdir()}


@pytest.mark.distributed
def test_gan_trains_identically_under_ddp_and_fsdp() -> None:
    means = {}
    for parallel, overrides in (("ddp", []), ("fsdp", FSDP)):
        result = check(torchrun(GAN, [*overrides, "--training_parameters.n_epochs", "16"]))
        means[parallel] = generated_means(result.stdout)
        assert "none written" in result.stdout
    before, after = means["ddp"]
    assert abs(before - 3.0) > 2.0 and abs(after - 3.0) < 0.5
    assert means["fsdp"] == means["ddp"]


def test_digits_reaches_90_percent_in_one_process() -> None:
    result = check(subprocess.run([sys.executable, str(DIGITS)], env=child_env(), cwd=REPO,
                                  capture_output=True, text=True, timeout=300))
    accuracy = float(re.search(r"val_accuracy=([\d.]+)", result.stdout).group(1))
    assert accuracy > 0.9


@pytest.mark.distributed
def test_digits_reaches_90_percent_on_two_ranks() -> None:
    result = check(torchrun(DIGITS))
    accuracies = re.findall(r"val_accuracy=([\d.]+)", result.stdout)
    assert len(accuracies) == 1, result.stdout  # printed by rank 0 only
    assert float(accuracies[0]) > 0.9


def test_digits_config_fields_are_command_line_overrides() -> None:
    sys.path.insert(0, str(DIGITS.parent))
    try:
        import digits
    finally:
        sys.path.remove(str(DIGITS.parent))
    config = digits.make_trainer(["--training_parameters.n_epochs", "3",
                                  "--hidden_size", "16"]).config
    assert (config.training_parameters.n_epochs, config.hidden_size) == (3, 16)
    assert config.training_parameters.train_batch_size == 32  # the script's value is kept


@dataclass(frozen=True)
class Pretrained:
    """The shortened char_gpt run that the resume and finetune tests start from."""

    root: Path
    stdout: str

    @property
    def checkpoints(self) -> Path:
        return self.root / "examples/char_gpt/gpt/checkpoints"


def output_dirs(root: Path) -> list[str]:
    return ["--checkpoint_parameters.root_dir", str(root), "--logging_parameters.log_dir",
            str(root)]


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory: pytest.TempPathFactory) -> Pretrained:
    root = tmp_path_factory.mktemp("char_gpt")
    result = check(torchrun(CHAR_GPT, [*TINY_GPT, *SHORT_RUN, *PRETRAIN_SCHEDULE,
                                       *output_dirs(root),
                                       "--training_parameters.n_epochs", str(PRETRAIN_EPOCHS)]))
    return Pretrained(root, result.stdout)


@pytest.mark.distributed
def test_char_gpt_loss_falls_and_the_run_says_where_its_files_went(
        pretrained: Pretrained) -> None:
    losses = val_losses(pretrained.stdout)
    # One validation before training, then one per epoch; rank 0 prints them, once each.
    assert [step for step, _ in losses] == [0, STEPS_PER_EPOCH, 2 * STEPS_PER_EPOCH]
    first, last = losses[0][1], losses[-1][1]
    assert abs(first - 5.55) < 0.3  # an untrained model: uniform over 256 bytes, ln(256)
    assert last < first - 1.5, pretrained.stdout
    assert printed_path(pretrained.stdout, "checkpoints") == pretrained.checkpoints
    assert (printed_path(pretrained.stdout, "logs") / "metrics.jsonl").is_file()
    assert step_dirs(pretrained.checkpoints) == {f"step_{STEPS_PER_EPOCH}",
                                                 f"step_{2 * STEPS_PER_EPOCH}"}


@pytest.mark.distributed
def test_char_gpt_trains_as_a_two_stage_pipeline(tmp_path: Path) -> None:
    result = check(torchrun(CHAR_GPT, [*TINY_GPT, *SHORT_RUN, *PRETRAIN_SCHEDULE,
                                       *output_dirs(tmp_path), "--training_parameters.n_epochs",
                                       "1", "--device_parameters.pipeline_parallel", "2"]))
    assert "parameters in rank 0's pipeline stage(s); starting at step 0" in result.stdout
    losses = val_losses(result.stdout)
    assert [step for step, _ in losses] == [0, STEPS_PER_EPOCH]
    assert abs(losses[0][1] - 5.55) < 0.3 and losses[-1][1] < losses[0][1] - 1.5
    assert "--- sample ---" not in result.stdout  # sampling calls the model directly
    assert step_dirs(printed_path(result.stdout, "checkpoints")) == {f"step_{STEPS_PER_EPOCH}"}


@pytest.mark.distributed
def test_char_gpt_resumes_from_its_latest_checkpoint(pretrained: Pretrained,
                                                     tmp_path: Path) -> None:
    root = tmp_path / "run"
    shutil.copytree(pretrained.root, root)  # the finetune test reads the original
    result = check(torchrun(CHAR_GPT, [*TINY_GPT, *SHORT_RUN, *PRETRAIN_SCHEDULE,
                                       *output_dirs(root), "--training_parameters.n_epochs",
                                       str(PRETRAIN_EPOCHS + 1),
                                       "--checkpoint_parameters.resume", "latest"]))
    saved_step = PRETRAIN_EPOCHS * STEPS_PER_EPOCH
    assert f"starting at step {saved_step}" in result.stdout
    losses = val_losses(result.stdout)
    assert [step for step, _ in losses] == [saved_step, saved_step + STEPS_PER_EPOCH]
    # Validating the restored weights gives exactly what the first run printed at that step.
    assert losses[0] == val_losses(pretrained.stdout)[-1]
    assert f"step_{saved_step + STEPS_PER_EPOCH}" in step_dirs(
        root / "examples/char_gpt/gpt/checkpoints")


@pytest.mark.distributed
def test_finetune_starts_from_the_pretrained_weights(pretrained: Pretrained,
                                                     tmp_path: Path) -> None:
    checkpoint = pretrained.checkpoints / f"step_{PRETRAIN_EPOCHS * STEPS_PER_EPOCH}"
    # Fine-tuning on the pretraining text makes the starting point comparable: the first
    # validation must see exactly the pretrained model, not a fresh one (about 5.55).
    result = check(torchrun(FINETUNE, [*TINY_GPT, *SHORT_RUN, *output_dirs(tmp_path),
                                       "--files", CHAR_GPT_FILES,
                                       "--training_parameters.n_epochs", "1",
                                       "--checkpoint_parameters.resume", str(checkpoint)]))
    losses = val_losses(result.stdout)
    (_, fresh), *_, (_, pretrained_loss) = val_losses(pretrained.stdout)
    assert losses[0] == (0, pretrained_loss)  # the pretrained weights, counters from 0
    assert losses[0][1] < fresh - 1.5
    assert [step for step, _ in losses] == [0, STEPS_PER_EPOCH]
    before, after = map(float, re.search(r"val_loss before fine-tuning=([\d.]+), "
                                         r"after \d+ steps=([\d.]+)", result.stdout).groups())
    assert (before, after) == (losses[0][1], losses[-1][1])
    assert printed_path(result.stdout, "checkpoints") == (
        tmp_path / "examples/char_gpt/finetune/checkpoints")
    assert step_dirs(printed_path(result.stdout, "checkpoints")) == {f"step_{STEPS_PER_EPOCH}"}


def test_finetune_without_a_pretrained_checkpoint_says_what_to_run(tmp_path: Path) -> None:
    result = subprocess.run([sys.executable, str(FINETUNE), "--checkpoint_parameters.resume",
                             str(tmp_path / "missing")], env=child_env(), cwd=tmp_path,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 1
    assert "run examples/char_gpt.py first" in result.stderr
