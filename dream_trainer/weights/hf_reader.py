"""Reading a rank's slices of safetensors files with plain reads, not a memory map.

DCP's ``HuggingFaceStorageReader`` slices each tensor out of safetensors' memory map. Every
page a rank touches then stays mapped, and counted in its resident memory, until the file is
closed, which for a model saved as one file is the end of the load: a rank that reads half
of every tensor holds half the file in mapped pages on top of its own shards. This reader
keeps DCP's planning and metadata and reads each requested box with ordinary reads through
one bounded buffer, straight into the rank's shard.
"""

from __future__ import annotations

import itertools
import json
import math
import struct
from typing import IO, Any

import torch
from torch.distributed.checkpoint import HuggingFaceStorageReader
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner, ReadItem
from torch.futures import Future

_BUFFER_BYTES = 16 * 2**20
_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16,
           "BF16": torch.bfloat16, "I64": torch.int64, "I32": torch.int32, "I16": torch.int16,
           "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool,
           "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}


class SliceReader(HuggingFaceStorageReader):
    """``HuggingFaceStorageReader`` whose reads go through a 16 MiB buffer, not a map."""

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        per_file: dict[str, list[ReadItem]] = {}
        for item in plan.items:
            per_file.setdefault(self.storage_data[item.storage_index].relative_path,
                                []).append(item)
        buffer = bytearray(_BUFFER_BYTES)
        for file_name, items in per_file.items():
            with open(file_name, "rb") as file:
                header, data_start = _header(file)
                for item in items:
                    _read_box(file, header[item.storage_index.fqn], data_start, item, planner,
                              buffer)
        done: Future[None] = Future()
        done.set_result(None)
        return done


def _header(file: IO[bytes]) -> tuple[dict[str, Any], int]:
    """The safetensors header (key -> dtype, shape, data offsets) and where data starts."""
    (length,) = struct.unpack("<Q", file.read(8))
    return json.loads(file.read(length)), 8 + length


def _read_box(file: IO[bytes], entry: dict[str, Any], data_start: int, item: ReadItem,
              planner: LoadPlanner, buffer: bytearray) -> None:
    """Copy the box ``item`` asks for, of the tensor ``entry`` describes, into its target.

    The box is read as runs that are contiguous in the file: the trailing dimensions it
    covers whole, together with its range of the dimension before them, form one run per
    index of the dimensions before that (a row-sharded weight is one run; a column-sharded
    one is one run per row).
    """
    dtype = _DTYPES[entry["dtype"]]
    shape = list(entry["shape"])
    offsets, lengths = list(item.storage_offsets), list(item.lengths)
    target = planner.resolve_tensor(item).detach()
    if target.numel() == 0:
        planner.commit_tensor(item, target)
        return
    whole = len(shape)
    while whole > 0 and offsets[whole - 1] == 0 and lengths[whole - 1] == shape[whole - 1]:
        whole -= 1
    inner = math.prod(shape[whole:])
    split = max(whole - 1, 0)  # the dimension whose range each run covers
    run = lengths[split] * math.prod(shape[split + 1:]) if whole else inner
    strides = [math.prod(shape[d + 1:]) for d in range(len(shape))]
    direct = target.is_contiguous()
    flat = target.view(-1) if direct \
        else torch.empty(target.numel(), dtype=target.dtype, device=target.device)
    element = dtype.itemsize
    written = 0
    for index in itertools.product(*(range(o, o + n) for o, n in zip(offsets[:split],
                                                                       lengths[:split]))):
        first = sum(i * s for i, s in zip(index, strides)) \
            + (offsets[split] * strides[split] if whole else 0)
        position = data_start + entry["data_offsets"][0] + first * element
        remaining = run
        while remaining:
            count = min(remaining, len(buffer) // element)
            file.seek(position)
            view = memoryview(buffer)[:count * element]
            if file.readinto(view) != len(view):
                raise OSError(f"{file.name} ends inside tensor data: the file is truncated")
            flat[written:written + count].copy_(torch.frombuffer(buffer, dtype=dtype,
                                                                 count=count))
            written += count
            remaining -= count
            position += count * element
    if not direct:
        target.copy_(flat.view(target.shape))
    planner.commit_tensor(item, target)
