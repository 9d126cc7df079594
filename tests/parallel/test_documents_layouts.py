"""Packed supervised fine-tuning on every layout that keeps documents apart equals one
process; the layouts that cannot yet (pipelines, context parallelism) refuse it by name."""

from __future__ import annotations

from pathlib import Path

import torch

from tests.helpers.launch import check, torchrun
from tests.scripts.documents_run import run

SCRIPT = Path(__file__).parents[1] / "scripts" / "documents_run.py"
# SGD steps of one computation summed in other orders (the data-parallel reduction, the
# tensor-parallel partial sums): weights of scale ~0.1-1 agree to float32 rounding.
TOLERANCE = 1e-6


def test_packed_sft_on_ddp_fsdp_and_tp_equals_one_process(tmp_path: Path) -> None:
    out = tmp_path / "runs.pt"
    check(torchrun(SCRIPT, [str(out), "ddp", "fsdp", "tp", "pp", "cp"], nproc=2, timeout=400))
    runs = torch.load(out, weights_only=False)
    single = run("single")
    assert single["steps"] == 3
    for layout in ("ddp", "fsdp", "tp"):
        assert runs[layout]["steps"] == 3, layout
        weights = runs[layout]["weights"]
        assert weights.keys() == single["weights"].keys()
        for name, value in single["weights"].items():
            assert (weights[name] - value).abs().max() <= TOLERANCE, (layout, name)
    # The runs trained: the weights moved from their start far more than the bound.
    moved = max(float((single["weights"][name] - value).abs().max())
                for name, value in single["initial"].items())
    assert moved > 1e-3
    assert runs["pp"] == {"refused": (
        "packed documents (self.documents) do not run under pipeline_parallel > 1 yet: the "
        "schedule cuts each batch into microbatches, and their document ids would have to "
        "reach every stage with them. Train packed documents with FSDP2, HSDP, DDP or tensor "
        "parallelism, or pack without documents=True")}
    assert runs["cp"]["refused"].startswith(
        "packed documents (self.documents) do not run under context_parallel > 1 yet")
