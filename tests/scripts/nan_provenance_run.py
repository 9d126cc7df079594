"""Script: NanGuard's diagnosis under 2 DDP ranks, where only rank 1 has the bad micro-batch.

Two runs, each stopped by the FloatingPointError on both ranks: ``forward`` (Boom armed on
micro-batch 1, the last of the first optimizer step's window, so that DDP's one-time bucket
rebuild is still due when the re-run starts) and ``backward`` (SqrtAtZero armed on
micro-batch 5, step 2). Each rank saves what it saw to ``<out>/rank<r>.pt``.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import torch

from dream_trainer.callbacks.nan_guard import NanGuard
from tests.helpers.provenance import ProvenanceTrainer, RecordBatch
from tests.helpers.toy import toy_config


def run(out: Path, fault: str, bad_batch: int) -> dict[str, Any]:
    guard, record = NanGuard(output_dir=out / "nan"), RecordBatch(bad_batch)
    trainer = ProvenanceTrainer(toy_config(callbacks=[record, guard], n_samples=96,
                                           gradient_accumulation_steps=2))
    trainer.fault, trainer.bad_batch, trainer.bad_rank = fault, bad_batch, 1
    try:
        trainer.fit()
    except FloatingPointError as error:
        message = str(error)
    else:
        raise AssertionError("NanGuard did not stop the run")
    report = guard.report
    assert report is not None
    (culprit,) = report.culprits
    return {
        "message": message,
        "ranks": report.ranks,
        "culprit": {"rank": culprit.rank, "kind": culprit.kind, "module": culprit.module,
                    "step": culprit.step, "batch_idx": culprit.batch_idx},
        "others": [(f.rank, f.kind) for f in report.findings if f is not culprit],
        "batch_file": str(culprit.batch_file),
        "trained_batch": record.batch,
        "global_step": trainer.global_step,
    }


if __name__ == "__main__":
    out = Path(sys.argv[1])
    runs = {"forward": run(out, "forward", 1), "backward": run(out, "backward", 5)}
    rank = int(os.environ["RANK"])
    torch.save(runs, out / f"rank{rank}.pt")
    print(f"rank {rank}: {runs['forward']['message']}", flush=True)
