"""Packed supervised fine-tuning equals one process on every layout: DDP, FSDP2, tensor
parallelism, a pipeline, context parallelism (documents across its cuts) and cp x FSDP2; a
pipeline with context parallelism refuses it by name."""

from __future__ import annotations

from pathlib import Path

import torch

from tests.helpers.launch import check, torchrun
from tests.scripts.documents_run import run

SCRIPT = Path(__file__).parents[1] / "scripts" / "documents_run.py"
# SGD steps of one computation summed in other orders (the data-parallel reduction, the
# tensor-parallel partial sums): weights of scale ~0.1-1 agree to float32 rounding.
TOLERANCE = 1e-6


def test_packed_sft_on_every_layout_equals_one_process(tmp_path: Path) -> None:
    two, four = tmp_path / "two.pt", tmp_path / "four.pt"
    check(torchrun(SCRIPT, [str(two), "ddp", "fsdp", "tp", "pp", "cp"], nproc=2, timeout=400))
    check(torchrun(SCRIPT, [str(four), "cp_fsdp", "pp_cp"], nproc=4, timeout=400))
    runs = {**torch.load(two, weights_only=False), **torch.load(four, weights_only=False)}
    single = run("single")
    assert single["steps"] == 3
    # The first sample's documents end at the cut between context-parallel chunks and span
    # the next one (documents_run.documents); cp holds chunks of 4 tokens. The pipeline
    # cuts each batch into 2 microbatches of 1 sequence, masked each by its own rows.
    for layout in ("ddp", "fsdp", "tp", "pp", "cp", "cp_fsdp"):
        assert runs[layout]["steps"] == 3, layout
        weights = runs[layout]["weights"]
        assert weights.keys() == single["weights"].keys()
        for name, value in single["weights"].items():
            assert (weights[name] - value).abs().max() <= TOLERANCE, (layout, name)
    # The runs trained: the weights moved from their start far more than the bound.
    moved = max(float((single["weights"][name] - value).abs().max())
                for name, value in single["initial"].items())
    assert moved > 1e-3
    assert runs["pp_cp"] == {"refused": (
        "packed documents (self.documents) do not run under pipeline_parallel > 1 with "
        "context_parallel > 1 yet: train them with one of the two, or pack without "
        "documents=True")}
