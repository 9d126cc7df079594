"""The examples of the large-model path run end to end: finetune_hf.py (a Hugging Face Llama
from its pretrained weights, pipelined, tied) and moe_gpt.py (mixture of experts, expert
parallelism). A file of their own, so that the suite's two workers can run them beside
test_examples.py's."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

from tests.examples.test_examples import TINY_GPT, output_dirs, val_losses
from tests.helpers.launch import REPO, check, child_env, torchrun

FINETUNE_HF = REPO / "examples/finetune_hf.py"


# A two-layer Llama of width 32 on 32-byte windows: a few seconds of training in one process.
TINY_LLAMA = ["--llama.hidden_size", "32", "--llama.intermediate_size", "64",
              "--llama.num_hidden_layers", "2", "--llama.context", "32"]
HF_SHORT_RUN = ["--training_parameters.n_epochs", "1",
                "--training_parameters.train_steps_per_epoch", "15",
                "--training_parameters.val_steps_per_epoch", "2"]


def test_finetune_hf_starts_from_the_pretrained_weights_and_exports_what_it_trained(
        tmp_path: Path) -> None:
    def run(*args: str) -> str:
        return check(subprocess.run([sys.executable, str(FINETUNE_HF), *TINY_LLAMA,
                                     *HF_SHORT_RUN, *args], env=child_env(), cwd=tmp_path,
                                    capture_output=True, text=True, timeout=300)).stdout

    first = run()
    outputs = tmp_path / "outputs/examples/finetune_hf"
    assert re.search(r"^started from (.+)$", first, re.M).group(1) == str(outputs / "pretrained")
    (_, start), (step, end) = val_losses(first)
    assert step == 15 and abs(start - 5.55) < 0.3  # the stand-in's weights are random
    assert end < start - 1.0, first
    # The exported model's loss against the trained one's: a loss of a few units here (it
    # started at ln(256) and fell by more than 1), of which 1e-5 is some tens of float32 ulps.
    assert float(re.search(r"loss differs by ([\d.e+-]+)", first).group(1)) <= 1e-5
    assert {p.name for p in (outputs / "exported").iterdir()} == {
        "config.json", "generation_config.json", "model.safetensors"}
    # Starting from the export continues exactly where the first run ended: the
    # validation before any step sees the fine-tuned model, not a fresh one.
    second = run("--init_weights_from", str(outputs / "exported"),
                 "--export_dir", str(tmp_path / "again"), "--experiment", "again")
    assert val_losses(second)[0] == (0, end)
    # The same trainer split into 2 pipeline stages on 2 ranks: each rank reads its stages'
    # pretrained weights, so validation starts where one process started, and the same
    # batches train it to where one process ended (printed to 4 decimals; float32 sums in
    # another order move the loss by ~1e-6).
    piped = check(torchrun(FINETUNE_HF, [*TINY_LLAMA, *HF_SHORT_RUN, "--experiment", "piped",
                                         "--device_parameters.pipeline_parallel", "2",
                                         "--export_dir", str(tmp_path / "piped")],
                           nproc=2, cwd=tmp_path, timeout=300)).stdout
    (_, piped_start), (piped_step, piped_end) = val_losses(piped)
    assert piped_step == 15
    assert abs(piped_start - start) <= 1.5e-4 and abs(piped_end - end) <= 1.5e-4, piped
    assert float(re.search(r"loss differs by ([\d.e+-]+)", piped).group(1)) <= 1e-5  # as above
    # The tied-embedding variant of the stand-in, pipelined: the embedding and the head are one
    # weight held by both stages; it trains, and the export ties them again (from_pretrained
    # loads one tensor and gives the trained loss).
    tied = check(torchrun(FINETUNE_HF, [*TINY_LLAMA, *HF_SHORT_RUN, "--experiment", "tied",
                                        "--device_parameters.pipeline_parallel", "2",
                                        "--llama.tie_word_embeddings", "true",
                                        "--export_dir", str(tmp_path / "tied")],
                          nproc=2, cwd=tmp_path, timeout=300)).stdout
    assert re.search(r"^started from (.+)$", tied, re.M).group(1) == str(
        outputs / "pretrained_tied")
    (_, tied_start), (tied_step, tied_end) = val_losses(tied)
    assert tied_step == 15 and tied_end < tied_start - 1.0, tied
    assert float(re.search(r"loss differs by ([\d.e+-]+)", tied).group(1)) <= 1e-5  # as above
    assert json.loads((tmp_path / "tied" / "config.json").read_text())["tie_word_embeddings"]


MOE_GPT = REPO / "examples/moe_gpt.py"
TINY_MOE = [*TINY_GPT, "--gpt.num_experts", "4", "--gpt.expert_hidden", "32",
            "--training_parameters.n_epochs", "1", "--training_parameters.train_steps_per_epoch",
            "15", "--training_parameters.train_batch_size", "8",
            "--training_parameters.val_steps_per_epoch", "2", "--sample_length", "0",
            "--learning_rate", "1e-2", "--warmup_steps", "5"]


def test_moe_gpt_trains_the_same_with_and_without_expert_parallelism(tmp_path: Path) -> None:
    # 2 ranks, FSDP2 over both: once with every expert on every rank, once with expert_parallel
    # 2 (each rank holds 2 of each layer's 4 experts, tokens cross by all-to-all). Same data,
    # same seed: the validation losses printed (4 decimals) agree, and the loss falls.
    def run(*args: str) -> str:
        return check(torchrun(MOE_GPT, [*TINY_MOE, *output_dirs(tmp_path), *args],
                              cwd=tmp_path, timeout=300)).stdout

    sharded = run("--experiment", "fsdp")
    expert_parallel = run("--experiment", "ep", "--device_parameters.expert_parallel", "2")
    (_, start), (step, end) = val_losses(sharded)
    assert step == 15 and abs(start - 5.55) < 0.1 and end < start - 1.0, sharded
    # AdamW on gradients summed in another order: ~1e-6 apart after 15 steps; the losses are
    # printed to 4 decimals.
    pairs = list(zip(val_losses(expert_parallel), val_losses(sharded), strict=True))
    assert all(a[0] == b[0] and abs(a[1] - b[1]) <= 2e-4 for a, b in pairs), expert_parallel
    assert "each token uses 38,464 of the 50,752 parameters" in sharded
    low, high = map(float, re.search(r"balancing bias: ([-+][\d.]+) \.\. ([-+][\d.]+)",
                                     expert_parallel).groups())
    assert low < 0 < high  # the bias moved the loads both ways
