"""Which checkpoints to keep: the best ``keep_top_k`` by ``monitor`` (or the newest), and
always the newest complete one."""

from __future__ import annotations

import shutil
from pathlib import Path

from dream_trainer.checkpoint.layout import complete_checkpoints, is_complete, step_dirs
from dream_trainer.configs.checkpoint import CheckpointParameters


def rotate(root: Path, params: CheckpointParameters, in_flight: Path | None) -> None:
    """Delete the checkpoints under ``root`` beyond ``keep_top_k``, and incomplete ones older
    than the newest complete one (but never ``in_flight``, an async save still writing)."""
    infos = complete_checkpoints(root)
    if not infos:
        return
    newest = infos[-1]
    for step, path in step_dirs(root):
        if step < newest.step and not is_complete(path) and path != in_flight:
            shutil.rmtree(path, ignore_errors=True)
    if params.keep_top_k is None:
        return
    if params.monitor is None:
        ranked = sorted(infos, key=lambda info: info.step, reverse=True)
    else:
        sign = 1.0 if params.mode == "min" else -1.0
        ranked = sorted(infos, key=lambda info: (info.score is None,
                                                 sign * (info.score or 0.0), -info.step))
    keep = {info.path for info in ranked[: params.keep_top_k]} | {newest.path}
    for info in infos:
        if info.path not in keep:
            shutil.rmtree(info.path, ignore_errors=True)
