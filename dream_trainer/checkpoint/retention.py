"""Which checkpoints to keep: the best ``keep_top_k`` by ``monitor`` (or the newest), and
always the newest complete one."""

from __future__ import annotations

import logging
import math

from dream_trainer.checkpoint.directory import (CheckpointInfo, complete_checkpoints, is_complete,
                                                step_dirs)
from dream_trainer.checkpoint.storage import storage_for
from dream_trainer.checkpoint.storage_base import Location
from dream_trainer.configs.checkpoint import CheckpointParameters

logger = logging.getLogger(__name__)

# The checkpoint directories whose unscored checkpoints were warned about: once per run.
_WARNED: set[Location] = set()


def rotate(root: Location, params: CheckpointParameters, in_flight: Location | None) -> None:
    """Delete the checkpoints under ``root`` beyond ``keep_top_k``, and incomplete ones older
    than the newest complete one (but never ``in_flight``, an async save still writing).

    A checkpoint whose ``monitor`` value is NaN or missing ranks below every scored one, in
    either ``mode``; the first such checkpoint under ``root`` is warned about."""
    storage = storage_for(root)
    infos = complete_checkpoints(root)
    if not infos:
        return
    newest = infos[-1]
    for step, path in step_dirs(root):
        if step < newest.step and not is_complete(path) and path != in_flight:
            storage.remove_tree(path)
    if params.keep_top_k is None:
        return
    if params.monitor is None:
        ranked = sorted(infos, key=lambda info: info.step, reverse=True)
    else:
        _warn_unscored(root, params.monitor, infos)
        sign = 1.0 if params.mode == "min" else -1.0
        ranked = sorted(infos, key=lambda info: _rank(info, sign))
    keep = {info.path for info in ranked[: params.keep_top_k]} | {newest.path}
    for info in infos:
        if info.path not in keep:
            storage.remove_tree(info.path)


def _unscored(info: CheckpointInfo) -> bool:
    return info.score is None or math.isnan(info.score)


def _rank(info: CheckpointInfo, sign: float) -> tuple[bool, float, int]:
    """Scored before unscored (NaN compares false with everything, which would leave sorted()
    in any order), then the best, then the newest."""
    if _unscored(info):
        return True, 0.0, -info.step
    return False, sign * info.score, -info.step  # type: ignore[operator]


def _warn_unscored(root: Location, monitor: str, infos: list[CheckpointInfo]) -> None:
    unscored = next((info for info in infos if _unscored(info)), None)
    if unscored is None or root in _WARNED:
        return
    _WARNED.add(root)
    value = "missing" if unscored.score is None else "NaN"
    logger.warning("checkpoint %s has monitor %r %s: keep_top_k ranks such checkpoints below "
                   "every checkpoint with a value (warned once per run)", unscored.path,
                   monitor, value)
