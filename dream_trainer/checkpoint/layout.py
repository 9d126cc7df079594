"""Where checkpoints live, which are complete, and whether their files are intact."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dream_trainer.errors import CheckpointError

logger = logging.getLogger(__name__)

METADATA = ".metadata"
INFO = "dream_trainer.json"
CONFIG = "config.json"
_STEP_DIR = re.compile(r"^step_(\d+)$")
_WRITER = re.compile(r"^__(\d+)_\d+\.distcp$")  # DCP's file names: __<rank>_<index>.distcp
_CHUNK = 1 << 22

MODEL_PREFIX = "state.models."
"""Where a checkpoint's DCP metadata keys model tensors: ``state.models.<model>.<key>``."""


@dataclass(frozen=True)
class CheckpointInfo:
    """What ``dream_trainer.json`` records about one checkpoint.

    It is written last, once every rank's data is written and every file is checksummed:
    its presence (with ``.metadata``) is what makes a checkpoint complete.

    Attributes:
        files: SHA-256 of every file of the checkpoint but this one, by relative path
            (``None`` for checkpoints written before checksums were recorded).
    """

    path: Path
    step: int
    epoch: int
    score: float | None
    files: dict[str, str] | None = None

    @classmethod
    def read(cls, path: Path) -> CheckpointInfo:
        data = json.loads((path / INFO).read_text())
        return cls(path, int(data["step"]), int(data["epoch"]), data.get("score"),
                   data.get("files"))

    def write(self) -> None:
        """Write atomically: a reader sees the whole file or none."""
        payload = {"step": self.step, "epoch": self.epoch, "score": self.score,
                   "files": self.files}
        temporary = self.path / f"{INFO}.tmp"
        temporary.write_text(json.dumps(payload, indent=2))
        os.replace(temporary, self.path / INFO)


def step_dir(root: Path, step: int) -> Path:
    return root / f"step_{step}"


def is_complete(path: Path) -> bool:
    """DCP writes ``.metadata`` (atomically, by rename) only after every rank's data, and
    ``dream_trainer.json`` is written after that."""
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


def data_files(metadata: Any) -> dict[str, int]:
    """Every file a checkpoint's metadata points into, with the length it needs."""
    needed: dict[str, int] = defaultdict(int)
    for info in metadata.storage_data.values():
        needed[info.relative_path] = max(needed[info.relative_path], info.offset + info.length)
    return dict(sorted(needed.items()))


def checksum(file: Path) -> str:
    """The SHA-256 of ``file`` (``sha256sum`` prints the same)."""
    digest = hashlib.sha256()
    with open(file, "rb") as handle:
        while chunk := handle.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def checksum_share(names: Any, rank: int, world_size: int) -> list[str]:
    """The files of ``names`` that ``rank`` checksums, when ``world_size`` ranks share it.

    The data files rank ``w`` wrote (``__w_<i>.distcp``) go to rank ``w % world_size``:
    after a save they are in its page cache, and on a resume in the same layout it reads
    them next, so checking them costs no read of another rank's data. The other files
    (metadata, config, files of unknown origin) are dealt round-robin. Every file goes to
    exactly one rank.
    """
    own, rest = [], []
    for name in sorted(names):
        writer = _WRITER.match(name)
        if writer is None:
            rest.append(name)
        elif int(writer.group(1)) % world_size == rank:
            own.append(name)
    return own + rest[rank::world_size]


def verify_files(path: Path, metadata: Any, rank: int = 0, world_size: int = 1) -> None:
    """Check that every data file the metadata points into exists, is long enough, and has
    the checksum recorded when the checkpoint was committed.

    Several ranks can share the reading: each checks its ``checksum_share`` of the files
    (and combines its verdict with the others').

    Raises:
        CheckpointError: naming the missing, truncated or altered file.
    """
    files = data_files(metadata)
    for relative, size in files.items():
        file = path / relative
        if not file.is_file():
            raise CheckpointError(f"checkpoint file {file} is missing")
        actual = file.stat().st_size
        if actual < size:
            raise CheckpointError(
                f"checkpoint file {file} is truncated: {actual} bytes, the metadata needs "
                f"{size}; resume from an earlier checkpoint"
            )
    recorded = CheckpointInfo.read(path).files if (path / INFO).is_file() else None
    if recorded is None:
        return  # written before checksums were recorded: lengths are all there is to check
    for relative in checksum_share(recorded, rank, world_size):
        file = path / relative
        if not file.is_file():
            raise CheckpointError(f"checkpoint file {file} is missing")
        if checksum(file) != recorded[relative]:
            raise CheckpointError(
                f"checkpoint file {file} does not match the checksum recorded when the "
                "checkpoint was written: its contents changed (a disk or copy error); "
                "resume from an earlier checkpoint"
            )
