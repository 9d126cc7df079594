"""examples/sft.py runs end to end: packed supervised fine-tuning of a transformers Llama from
local files, on one process and on 2 FSDP2 ranks, exported in the Hugging Face layout."""

from __future__ import annotations

import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from tests.examples.test_examples import val_losses
from tests.helpers.launch import REPO, check, child_env, torchrun

SFT = REPO / "examples/sft.py"
STEPS = 12
# A two-layer Llama of width 32 on sequences of 64 tokens (several conversations each, the
# longest split over up to three): a few seconds of training in one process.
TINY_LLAMA = ["--llama.hidden_size", "32", "--llama.intermediate_size", "64",
              "--llama.num_hidden_layers", "2", "--llama.context", "64"]
SHORT_RUN = ["--training_parameters.n_epochs", "1",
             "--training_parameters.train_steps_per_epoch", str(STEPS),
             "--training_parameters.val_steps_per_epoch", "1"]


@dataclass(frozen=True)
class OneProcess:
    """The one-process run: where it ran, what it printed."""

    root: Path
    stdout: str

    @property
    def outputs(self) -> Path:
        return self.root / "outputs/examples/sft"


def logits(model_dir: Path, outputs: Path) -> torch.Tensor:
    """The logits of ``model_dir``'s model (loaded as a user would) on the first held-out
    conversation."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from dream_trainer.data import ChatDataset

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    ids = ChatDataset(outputs / "val_chats.jsonl", tokenizer)[0]["input_ids"]
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    with torch.no_grad():
        return model(torch.tensor([ids])).logits


def differs_by(stdout: str) -> float:
    return float(re.search(r"logits differ by ([\d.e+-]+)", stdout).group(1))


@pytest.fixture(scope="module")
def one_process(tmp_path_factory: pytest.TempPathFactory) -> OneProcess:
    root = tmp_path_factory.mktemp("sft")
    result = check(subprocess.run([sys.executable, str(SFT), *TINY_LLAMA, *SHORT_RUN,
                                   "--training_parameters.train_batch_size", "8"],
                                  env=child_env(), cwd=root, capture_output=True, text=True,
                                  timeout=300))
    return OneProcess(root, result.stdout)


def test_sft_learns_the_assistant_turns_and_exports_what_it_trained(
        one_process: OneProcess) -> None:
    out, outputs = one_process.stdout, one_process.outputs
    assert re.search(r"^started from (.+)$", out, re.M).group(1) == str(outputs / "pretrained")
    (_, start), (step, end) = val_losses(out)
    # The stand-in's weights are random: about ln(vocabulary) = ln(28) = 3.33 per token.
    assert step == STEPS and abs(start - 3.33) < 0.2, out
    assert end < start - 0.5, out
    # from_pretrained on the export runs the computation the trained model ran, on the same
    # weights, in one process: equal logits.
    assert differs_by(out) == 0.0, out
    exported = outputs / "exported"
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {
        p.name for p in exported.iterdir()}
    # The export is the fine-tuned model, not the stand-in it started from: its logits moved
    # by far more than rounding (they start near 0 and end at a scale of about 1).
    assert (logits(exported, outputs) - logits(outputs / "pretrained", outputs)).abs().max() > 0.5


@pytest.mark.distributed
def test_sft_on_two_fsdp2_ranks_trains_what_one_process_trains(
        one_process: OneProcess, tmp_path: Path) -> None:
    outputs = one_process.outputs
    # Half the batch on each rank: the same global batches of the same global order, and
    # num_items (the trained tokens of the global batch) gives the same mean loss.
    result = check(torchrun(SFT, [*TINY_LLAMA, *SHORT_RUN, "--experiment", "fsdp",
                                  "--training_parameters.train_batch_size", "4",
                                  "--device_parameters.dp_shard", "2",
                                  "--init_weights_from", str(outputs / "pretrained"),
                                  "--chats", str(outputs / "chats.jsonl"),
                                  "--val_chats", str(outputs / "val_chats.jsonl"),
                                  "--export_dir", str(tmp_path / "exported")],
                            nproc=2, cwd=tmp_path, timeout=300))
    out = result.stdout
    assert "started from" in out and len(val_losses(out)) == 2, out  # printed by rank 0 only
    (_, start), (step, end) = val_losses(out)
    assert step == STEPS and end < start - 0.5, out
    # The trained model and the consolidated export: up to float rounding (logits of scale
    # about 1; 1e-5 is some tens of float32 ulps).
    assert differs_by(out) <= 1e-5, out
    # The two layouts sum the gradients in another order, and AdamW's updates carry that
    # rounding through 12 steps: within 1e-4 of the logits' scale (about 1: some hundreds of
    # float32 ulps; 3 were seen), far below the ~1.5 the training moved them.
    two_ranks = logits(tmp_path / "exported", outputs)
    one = logits(outputs / "exported", outputs)
    assert (two_ranks - one).abs().max() <= 1e-4 * one.abs().max()
