"""Reading what an offline wandb run wrote, from its ``run-<id>.wandb`` record log."""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

_HEADER = 7  # ":W&B" magic, 2-byte magic, 1-byte version
_BLOCK = 32768  # records are framed in LevelDB-log blocks: crc(4) length(2) type(1) data


def _records(path: Path) -> Iterator[bytes]:
    data = path.read_bytes()
    pos, pending = _HEADER, b""
    while pos + 7 <= len(data):
        if _BLOCK - pos % _BLOCK < 7:  # block trailer padding
            pos += _BLOCK - pos % _BLOCK
            continue
        length, kind = struct.unpack("<HB", data[pos + 4:pos + 7])
        pending += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # FULL or LAST fragment
            yield pending
            pending = b""


def read_run(path: Path) -> dict[str, Any]:
    """The run id, project, group, name and history rows (``{key: value}`` with ``_step``)."""
    from wandb.proto import wandb_internal_pb2 as pb

    run: dict[str, Any] = {"history": []}
    for raw in _records(path):
        record = pb.Record()
        record.ParseFromString(raw)
        kind = record.WhichOneof("record_type")
        if kind == "run":
            run.update(id=record.run.run_id, project=record.run.project,
                       group=record.run.run_group, name=record.run.display_name)
        elif kind == "history":
            run["history"].append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                                   for item in record.history.item})
    return run
