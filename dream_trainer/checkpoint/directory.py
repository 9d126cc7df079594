"""Where checkpoints live, which are complete, and whether their files are intact."""

from __future__ import annotations

import hashlib
import json
import logging
import re
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

from dream_trainer.checkpoint.declared import check_declared_sizes
from dream_trainer.checkpoint.storage import storage_for
from dream_trainer.checkpoint.storage_base import Location
from dream_trainer.errors import CheckpointError
from dream_trainer.utils.bounded import read_bounded

logger = logging.getLogger(__name__)

METADATA = ".metadata"
INFO = "dream_trainer.json"
CONFIG = "config.json"
RECORD = "models.json"
"""What a checkpoint records of its models beside their state: the sources of the frozen
weights it leaves out, the adapters' configs (``checkpoint.frozen``)."""
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

    path: Location
    step: int
    epoch: int
    score: float | None
    files: dict[str, str] | None = None

    @classmethod
    def read(cls, path: Location) -> CheckpointInfo:
        """Read the ``dream_trainer.json`` of the checkpoint at ``path``.

        Raises:
            CheckpointError: naming the file, if it is not JSON or lacks a field.
        """
        file = path / INFO
        try:
            with storage_for(file).open_file(file) as handle:
                data = json.loads(read_bounded(handle, file))
            problem = _record_problem(data)
        except (OSError, ValueError, RecursionError, CheckpointError) as exc:
            # ValueError: not JSON or UTF-8, or over the limit; CheckpointError: missing
            problem = f"{type(exc).__name__}: {exc}"
        if problem is not None:
            raise CheckpointError(
                f"{file} cannot be read ({problem}): the checkpoint is damaged. Resume from "
                "another checkpoint (resume='latest' skips this one) or delete it")
        return cls(path, data["step"], data["epoch"], data.get("score"), data.get("files"))

    def write(self) -> None:
        """Write atomically: a reader sees the whole file or none."""
        payload = {"step": self.step, "epoch": self.epoch, "score": self.score,
                   "files": self.files}
        storage_for(self.path).write_bytes(self.path / INFO,
                                           json.dumps(payload, indent=2).encode())


def _record_problem(data: Any) -> str | None:
    """What makes ``data`` not a ``dream_trainer.json`` record, or None."""
    if not isinstance(data, dict):
        return f"a JSON {type(data).__name__}, not an object"
    for field in ("step", "epoch"):
        value = data.get(field)
        if type(value) is not int or value < 0:
            return f"{field!r} is {value!r}, not a step count"
    score = data.get("score")
    if score is not None and type(score) not in (int, float):
        return f"'score' is {score!r}, not a number"
    files = data.get("files")
    if files is not None and not (isinstance(files, dict) and all(
            isinstance(name, str) and isinstance(digest, str)
            for name, digest in files.items())):
        return "'files' is not an object of file names and checksums"
    return None


def step_dir(root: Location, step: int) -> Location:
    return root / f"step_{step}"


def is_complete(path: Location) -> bool:
    """DCP writes ``.metadata`` (atomically, by rename) only after every rank's data, and
    ``dream_trainer.json`` is written after that."""
    storage = storage_for(path)
    return storage.is_file(path / METADATA) and storage.is_file(path / INFO)


def step_dirs(root: Location) -> list[tuple[int, Location]]:
    """Every ``step_<N>`` directory under ``root``, complete or not, by step."""
    found = [(int(m.group(1)), root / name) for name, is_dir in storage_for(root).list_dir(root)
             if is_dir and (m := _STEP_DIR.match(name))]
    return sorted(found, key=lambda entry: entry[0])


def complete_checkpoints(root: Location, warn: bool = False) -> list[CheckpointInfo]:
    """The complete checkpoints under ``root``, oldest first.

    Incomplete ones are skipped, and so are those whose ``dream_trainer.json`` cannot be
    read: no caller can rank, resume or delete a checkpoint it knows nothing about.

    Args:
        warn: Log a warning for each checkpoint skipped.
    """
    infos = []
    for _, path in step_dirs(root):
        if not is_complete(path):
            if warn:
                logger.warning("skipping %s: it was not completely written (no %s)", path,
                               METADATA)
            continue
        try:
            infos.append(CheckpointInfo.read(path))
        except CheckpointError as exc:
            if warn:
                logger.warning("skipping %s: %s", path, exc)
    return infos


def data_files(metadata: Any) -> dict[str, int]:
    """Every file a checkpoint's metadata points into, with the length it needs."""
    needed: dict[str, int] = defaultdict(int)
    for info in metadata.storage_data.values():
        needed[info.relative_path] = max(needed[info.relative_path], info.offset + info.length)
    return dict(sorted(needed.items()))


def checksum(file: Location) -> str:
    """The SHA-256 of ``file`` (``sha256sum`` prints the same)."""
    digest = hashlib.sha256()
    with storage_for(file).open(file) as handle:
        while chunk := handle.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def written_files(path: Location) -> list[str]:
    """The files a save just wrote in ``path``: DCP's data files, ``.metadata``, the
    config and the models' record. Listed rather than read from ``.metadata``, whose decoding costs seconds for a
    checkpoint of many ranks."""
    return sorted(name for name, is_dir in storage_for(path).list_dir(path)
                  if not is_dir and (_WRITER.match(name) or name in (METADATA, CONFIG, RECORD)))


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


def verify_files(path: Location, metadata: Any, rank: int = 0, world_size: int = 1) -> None:
    """Check that every tensor's declared size is backed by stored bytes (see
    ``check_declared_sizes``), and every file the metadata points into is a regular file
    inside the checkpoint, long enough, and (for a checkpoint with checksums) covered by a
    checksum recorded when the checkpoint was committed, which it still matches.

    Several ranks can share the reading: each checks its ``checksum_share`` of the files
    (and combines its verdict with the others'); the cheap checks run on every rank.

    Raises:
        CheckpointError: naming the tensor whose size its chunks do not back, or the file
            that lies outside the checkpoint, is a symbolic link, is missing, truncated,
            covered by no checksum, or altered.
    """
    check_declared_sizes(path / METADATA, metadata)
    needed = data_files(metadata)
    recorded = CheckpointInfo.read(path).files if storage_for(path).is_file(path / INFO) \
        else None
    sizes = {name: entry_size(path, name, path / METADATA) for name in needed}
    for name in [*(recorded or {}), METADATA]:
        entry_size(path, name, path / INFO)
    for relative, size in needed.items():
        if sizes[relative] < size:
            raise CheckpointError(
                f"checkpoint file {path / relative} is truncated: {sizes[relative]} bytes, the "
                f"metadata needs {size}; resume from an earlier checkpoint"
            )
        if recorded is not None and relative not in recorded:
            raise CheckpointError(
                f"checkpoint file {path / relative} is covered by none of the checksums that "
                f"{path / INFO} recorded when the checkpoint was written: its metadata was "
                "altered to read a file the save did not write; resume from an earlier "
                "checkpoint")
    if recorded is None:
        return  # written before checksums were recorded: lengths are all there is to check
    for relative in checksum_share(recorded, rank, world_size):
        if checksum(path / relative) != recorded[relative]:
            raise CheckpointError(
                f"checkpoint file {path / relative} does not match the checksum recorded when "
                "the checkpoint was written: its contents changed (a disk or copy error); "
                "resume from an earlier checkpoint"
            )


def entry_size(path: Location, name: Any, source: Location) -> int:
    """The size of the regular file ``name`` that ``source`` names in the checkpoint ``path``.

    Raises:
        CheckpointError: if ``name`` is not a plain file name (it would reach outside the
            checkpoint), or the entry is missing, a symbolic link or not a regular file.
    """
    return storage_for(path).entry_size(path, name, source)
