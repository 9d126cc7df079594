"""Crafted checkpoint inputs whose few bytes would cost a reader hours or gigabytes, built the
way an attacker who can write the checkpoint folder builds them: from a real checkpoint, with
the checksums in ``dream_trainer.json`` recomputed."""

from __future__ import annotations

import collections
import dataclasses
import io
import json
import pickle
import shutil
import struct
import subprocess
import sys
import zipfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from dream_trainer.checkpoint.directory import INFO, METADATA, checksum
from tests.helpers.checkpointing import CheckpointedTrainer, checkpointed_config
from tests.helpers.launch import REPO, child_env

Craft = Callable[[Path], int]
"""Alters a copy of a checkpoint in place; returns the crafted file's (or item's) bytes."""


def one_epoch_checkpoint(root: Path) -> Path:
    """A normal checkpoint of a one-epoch toy run under ``root`` (its step_10, ~90 KB)."""
    config = checkpointed_config(root, resume=None, every_n_steps=None)
    CheckpointedTrainer(config.model_copy(update={
        "training_parameters": config.training_parameters.model_copy(update={"n_epochs": 1})
    })).fit()
    return root / "ckpt/tests/run/checkpoints/step_10"


def measure_reads(inputs: Mapping[str, tuple[Craft, tuple[str, ...], Any]], clean: Path,
                  work: Path, warm: str) -> dict[str, Any]:
    """Each input (name: craft, entry points, expected) crafted on a copy of ``clean`` and
    read through each of its entry points, in that order, in one process
    (tests/scripts/crafted_costs.py): ``{"name/entry": {"seconds", "peak", "error",
    "size"}, "warm": the peak after the case ``warm``}``."""
    cases, sizes = [], {}
    for name, (craft, entries, _) in inputs.items():
        checkpoint = work / name / "step_10"
        shutil.copytree(clean, checkpoint)
        size = craft(checkpoint)
        for entry in entries:
            cases.append({"name": f"{name}/{entry}", "entry": entry,
                          "checkpoint": str(checkpoint), "root": str(work / name / entry)})
            sizes[f"{name}/{entry}"] = size
    (work / "cases.json").write_text(json.dumps(cases))
    result = subprocess.run([sys.executable, str(REPO / "tests/scripts/crafted_costs.py"),
                             str(work / "cases.json")], capture_output=True, text=True,
                            env=child_env(), cwd=REPO, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    measured = {case["name"]: {**case, "size": sizes[case["name"]]}
                for case in report["cases"]}
    return {**measured, "warm": measured[warm]["peak"]}


def rechecksum(checkpoint: Path, only: str | None = None) -> None:
    """Recompute the checksums recorded in ``dream_trainer.json`` (of every file, or of
    ``only`` that one) as an attacker would, so that only the decoder stands between the
    file and its payload."""
    info = json.loads((checkpoint / INFO).read_text())
    info["files"] = {name: checksum(checkpoint / name) if only in (None, name) else digest
                     for name, digest in info["files"].items()}
    (checkpoint / INFO).write_text(json.dumps(info))


def metadata_of(checkpoint: Path) -> Any:
    return pickle.loads((checkpoint / METADATA).read_bytes())  # our own file: trusted


def tensor_index(checkpoint: Path, prefix: str = "state.models.") -> Any:
    """The ``MetadataIndex`` of the first stored tensor chunk whose name starts ``prefix``."""
    return min((index for index in metadata_of(checkpoint).storage_data
                if index.fqn.startswith(prefix) and index.offset is not None),
               key=lambda index: index.fqn)


def stored(checkpoint: Path, index: Any) -> bytes:
    """The bytes DCP stored for ``index`` (a ``MetadataIndex``, or an item's name)."""
    from torch.distributed.checkpoint.metadata import MetadataIndex

    index = MetadataIndex(index) if isinstance(index, str) else index
    info = metadata_of(checkpoint).storage_data[index]
    data = (checkpoint / info.relative_path).read_bytes()
    return data[info.offset:info.offset + info.length]


def replace_stored(checkpoint: Path, index: Any, blob: bytes) -> None:
    """Put ``blob`` where DCP stored ``index`` (a ``MetadataIndex``, or an item's name),
    shifting what follows in its file, and rewrite the metadata and the checksums."""
    from torch.distributed.checkpoint.metadata import MetadataIndex

    index = MetadataIndex(index) if isinstance(index, str) else index
    metadata = metadata_of(checkpoint)
    info = metadata.storage_data[index]
    path = checkpoint / info.relative_path
    data = path.read_bytes()
    path.write_bytes(data[:info.offset] + blob + data[info.offset + info.length:])
    shift = len(blob) - info.length
    for key, other in list(metadata.storage_data.items()):
        if other.relative_path == info.relative_path and other.offset > info.offset:
            metadata.storage_data[key] = dataclasses.replace(other, offset=other.offset + shift)
    metadata.storage_data[index] = dataclasses.replace(info, length=len(blob))
    (checkpoint / METADATA).write_bytes(pickle.dumps(metadata))
    rechecksum(checkpoint)


def packed(value: Any) -> bytes:
    """``value`` as ``torch.save`` writes it (as dream_trainer packs a state, and as DCP stores
    a non-tensor item)."""
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def with_packed_extra(checkpoint: Path, **extra: Any) -> None:
    """Add ``extra`` to the trainer's shared packed state (item ``state.objects``)."""
    inner = torch.load(io.BytesIO(torch.load(io.BytesIO(stored(checkpoint, "state.objects")),
                                             weights_only=False)), weights_only=False)
    inner["extra"].update(extra)
    replace_stored(checkpoint, "state.objects", packed(packed(inner)))


# -- the inputs -----------------------------------------------------------------------------
def deep_config(depth: int, leaves: int, key: str) -> dict[str, Any]:
    """A config nested ``depth`` levels under long keys, three leaves a level: every leaf's
    dotted name is as long as the file, so joining them all is quadratic."""
    tree: dict[str, Any] = {}
    node = tree
    for _ in range(depth):
        node.update({f"l{j}": j for j in range(3)})
        node[key] = {}
        node = node[key]
    node.update({f"x{j}": j for j in range(leaves)})
    return tree


def dag_key(depth: int) -> bytes:
    """Opcodes that build ``{t_depth: 1}`` with ``t_i = (t_(i-1), t_(i-1))`` (``DUP`` shares
    each level, so the key takes 2 bytes a level and expands to 2**depth values), then drop
    it: prepended to a pickle, they leave the rest to load."""
    return b"\x80\x02}K\x00" + b"2\x86" * depth + b"K\x01s0"


def shared_lists(depth: int) -> list[Any]:
    """``l_depth`` with ``l_i = [l_(i-1), l_(i-1)]``: ``depth`` lists, 2**depth as a tree."""
    value: list[Any] = []
    for _ in range(depth):
        value = [value, value]
    return value


class _StorageRef:
    def __init__(self, key: str, count: int) -> None:
        self.key, self.count = key, count


class _View:
    """Pickles as torch.save writes a float32 tensor (``_rebuild_tensor_v2``), with any size."""

    def __init__(self, storage: _StorageRef, size: tuple[int, ...],
                 stride: tuple[int, ...]) -> None:
        self.storage, self.size, self.stride = storage, size, stride

    def __reduce__(self) -> tuple[Any, ...]:
        return torch._utils._rebuild_tensor_v2, (self.storage, 0, self.size, self.stride,
                                                 False, collections.OrderedDict())


class _Pickler(pickle.Pickler):
    def persistent_id(self, obj: Any) -> Any:
        if isinstance(obj, _StorageRef):
            return ("storage", torch.FloatStorage, obj.key, "cpu", obj.count)
        return None


def claims_more_than_it_holds(claimed: int) -> bytes:
    """A ``torch.save`` archive of one float32 whose zip records (and pickle) say its storage
    member holds ``claimed`` bytes."""
    data = io.BytesIO()
    _Pickler(data, protocol=2).dump(_View(_StorageRef("0", claimed // 4), (1,), (1,)))
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as archive:
        archive.writestr("archive/data.pkl", data.getvalue())
        archive.writestr("archive/data/0", struct.pack("<f", 1.0))
    raw = bytearray(out.getvalue())
    name = b"archive/data/0"
    # The sizes sit at byte 20 of a central directory record (name at 46), 18 of a local
    # header (name at 30).
    for signature, sizes, named in ((b"PK\x01\x02", 20, 46), (b"PK\x03\x04", 18, 30)):
        start = raw.index(signature)
        while raw[start + named:start + named + len(name)] != name:
            start = raw.index(signature, start + 1)
        raw[start + sizes:start + sizes + 8] = struct.pack("<II", claimed, claimed)
    return bytes(raw)
