"""Where checkpoints live, which are complete, and whether their files are intact."""

from __future__ import annotations

import json
import logging
import re
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

METADATA = ".metadata"
INFO = "dream_trainer.json"
CONFIG = "config.json"
_STEP_DIR = re.compile(r"^step_(\d+)$")


class CheckpointError(RuntimeError):
    """A checkpoint cannot be used: missing, incomplete, damaged or incompatible."""


@dataclass(frozen=True)
class CheckpointInfo:
    """What ``dream_trainer.json`` records about one checkpoint."""

    path: Path
    step: int
    epoch: int
    score: float | None

    @classmethod
    def read(cls, path: Path) -> CheckpointInfo:
        data = json.loads((path / INFO).read_text())
        return cls(path, int(data["step"]), int(data["epoch"]), data.get("score"))

    def write(self) -> None:
        payload = {"step": self.step, "epoch": self.epoch, "score": self.score}
        (self.path / INFO).write_text(json.dumps(payload, indent=2))


def step_dir(root: Path, step: int) -> Path:
    return root / f"step_{step}"


def is_complete(path: Path) -> bool:
    """DCP writes ``.metadata`` (atomically, by rename) only after every rank's data."""
    return (path / METADATA).is_file() and (path / INFO).is_file()


def step_dirs(root: Path) -> list[tuple[int, Path]]:
    """Every ``step_<N>`` directory under ``root``, complete or not, by step."""
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir()
             if p.is_dir() and (m := _STEP_DIR.match(p.name))]
    return sorted(found)


def complete_checkpoints(root: Path, warn: bool = False) -> list[CheckpointInfo]:
    """The complete checkpoints under ``root``, oldest first; incomplete ones are skipped."""
    infos = []
    for _, path in step_dirs(root):
        if is_complete(path):
            infos.append(CheckpointInfo.read(path))
        elif warn:
            logger.warning("skipping %s: it was not completely written (no %s)", path,
                           METADATA)
    return infos


def verify_files(path: Path, metadata: Any) -> None:
    """Check that every data file the metadata points into exists and is long enough.

    Raises:
        CheckpointError: naming the missing or truncated file.
    """
    needed: dict[str, int] = defaultdict(int)
    for info in metadata.storage_data.values():
        needed[info.relative_path] = max(needed[info.relative_path], info.offset + info.length)
    for relative, size in sorted(needed.items()):
        file = path / relative
        if not file.is_file():
            raise CheckpointError(f"checkpoint file {file} is missing")
        actual = file.stat().st_size
        if actual < size:
            raise CheckpointError(
                f"checkpoint file {file} is truncated: {actual} bytes, the metadata needs "
                f"{size}; resume from an earlier checkpoint"
            )
