"""Read checkpoints through each entry point in one process and print what each read cost.

Usage: ``python crafted_costs.py CASES.json``, where the file lists ``{"name", "entry":
"resume" | "init" | "export" | "export_hf", "checkpoint", "root"}``. Prints one JSON object:
``after_imports`` (peak resident bytes then) and, per case in order, its seconds, the peak
resident bytes after it (``ru_maxrss`` only grows: a case's cost is the growth over the
cases before it) and the error it raised, if any, as ``Type: message``.
"""

from __future__ import annotations

import json
import resource
import sys
import time
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint.api import CheckpointException

from dream_trainer.checkpoint.export import export_checkpoint
from tests.helpers.checkpointing import CheckpointedTrainer, checkpointed_config


def peak() -> int:
    """The process's peak resident bytes so far (Linux reports kilobytes)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def one_epoch(root: Path, **checkpoint: Any) -> Any:
    config = checkpointed_config(root, **checkpoint)
    return config.model_copy(update={"training_parameters": config.training_parameters
                                     .model_copy(update={"n_epochs": 1})})


def read(entry: str, checkpoint: Path, root: Path) -> None:
    if entry == "resume":
        CheckpointedTrainer(one_epoch(root, resume=checkpoint, every_n_steps=None)).fit()
    elif entry == "init":
        config = one_epoch(root, resume=None, every_n_steps=None)
        CheckpointedTrainer(config.model_copy(update={"init_weights_from": checkpoint})).fit()
    elif entry == "export_hf":
        export_checkpoint(checkpoint, root / "exported", format="hf", model_type="mixtral")
    else:
        export_checkpoint(checkpoint, root / "exported")


def main() -> None:
    cases = json.loads(Path(sys.argv[1]).read_text())
    report: dict[str, Any] = {"after_imports": peak(), "cases": []}
    for case in cases:
        start = time.perf_counter()
        error = None
        try:
            read(case["entry"], Path(case["checkpoint"]), Path(case["root"]))
        except (Exception, CheckpointException) as exc:  # reported, judged by the test
            error = f"{type(exc).__name__}: {exc}"
        report["cases"].append({"name": case["name"], "seconds": time.perf_counter() - start,
                                "peak": peak(), "error": error})
    print(json.dumps(report))


if __name__ == "__main__":
    main()
