"""Reading a rank's slices of safetensors files with plain reads, not a memory map.

DCP's ``HuggingFaceStorageReader`` slices each tensor out of safetensors' memory map. Every
page a rank touches then stays mapped, and counted in its resident memory, until the file is
closed, which for a model saved as one file is the end of the load: a rank that reads half
of every tensor holds half the file in mapped pages on top of its own shards. This reader
plans as DCP's does and reads each requested box with ordinary reads through one bounded
buffer, straight into the rank's shard. Files are opened through ``Files`` (a local directory
or an object store), so from ``s3://`` too a rank fetches only the byte ranges of its boxes.

Before any read it checks what DCP's reader takes on trust: every file's header is a valid
safetensors header whose tensors fill its data exactly, with only dtypes this reader knows,
and the chunks of every tensor (several files may each hold a part, placed by their
``DCP_SHARDING_INFO``) cover it exactly once (``utils.boxes``: in linear time, so a folder of
a million one-element chunks is checked in seconds). With the shapes matched to the model's
(``PretrainedWeights``), every element of every target tensor is then written by the load.
``BoxPlanner`` adds the file tensors that fill slices of a stacked parameter
(``weights.stacked``): a rank reads only the parts of them that its shard holds.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from typing import IO, Any

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, Metadata,
                                                   MetadataIndex, StorageMeta,
                                                   TensorProperties, TensorStorageMetadata)
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list
from torch.futures import Future

from dream_trainer.errors import CheckpointError
from dream_trainer.utils.boxes import tiling_problem
from dream_trainer.weights.hf import Files, safetensors_names
from dream_trainer.weights.stacked import Box

_BUFFER_BYTES = 16 * 2**20
_MAX_HEADER_BYTES = 100 * 2**20  # the safetensors format's own limit
_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16,
           "BF16": torch.bfloat16, "I64": torch.int64, "I32": torch.int32, "I16": torch.int16,
           "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool,
           "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}


_SHOWN = 8  # chunks or files an error lists: a million would make a message of megabytes
_SHARDING_INFO = "DCP_SHARDING_INFO"  # torch's key for where a file's chunk of a tensor sits
_OFFSETS = "saved_offsets"


@dataclass(frozen=True)
class _Stored:
    """Where one chunk lies: its file (a name in the directory), where the file's data
    starts, and the chunk's header entry (dtype, shape, data offsets)."""

    file: str
    data_start: int
    entry: dict[str, Any]


class SliceReader(FileSystemReader):
    """A DCP storage reader of a Hugging Face directory whose reads go through a 16 MiB
    buffer, not a map.

    Args:
        directory: The directory (a ``Path``, or a location of ``files``).
        files: The storage that holds it.
    """

    def __init__(self, directory: Any, files: Files) -> None:
        super().__init__(str(directory))
        self.directory = directory
        self.files = files

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """The tensors of the directory's safetensors files and where their chunks lie,
        from the files' headers (a few reads per file).

        Raises:
            CheckpointError: naming the file that is damaged or truncated, holds a dtype
                this reader cannot read or a malformed ``DCP_SHARDING_INFO``; or the tensor
                whose chunks leave elements unwritten or overlap, and its files.
        """
        tensors: dict[str, TensorStorageMetadata] = {}
        storage_data: dict[MetadataIndex, _Stored] = {}
        for name in safetensors_names(self.directory, self.files):
            path = self.directory / name
            with self.files.open_file(path) as file:
                header, data_start = _checked_header(file, path)
            placed = _placement(header.pop("__metadata__", None) or {}, header, path)
            for key, entry in header.items():
                shape, offsets = list(entry["shape"]), placed.get(key, [0] * len(entry["shape"]))
                chunk = ChunkStorageMetadata(offsets=torch.Size(offsets),
                                             sizes=torch.Size(shape))
                known = tensors.get(key)
                if known is None:
                    tensors[key] = TensorStorageMetadata(
                        properties=TensorProperties(dtype=_DTYPES[entry["dtype"]]),
                        size=torch.Size([o + n for o, n in zip(offsets, shape)]),
                        chunks=[chunk])
                else:
                    known.chunks.append(chunk)
                    known.size = torch.Size([max(size, o + n) for size, o, n
                                             in zip(known.size, offsets, shape)])
                storage_data[MetadataIndex(fqn=key, offset=offsets)] = _Stored(
                    name, data_start, entry)
        metadata = Metadata(state_dict_metadata=tensors,  # type: ignore[arg-type]
                            storage_data=storage_data)
        for fqn, entry in tensors.items():
            _check_coverage(fqn, entry, metadata, self.directory)
        metadata.storage_meta = StorageMeta(load_id=self.load_id)
        return metadata

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        per_file: dict[str, list[ReadItem]] = {}
        for item in plan.items:
            per_file.setdefault(self.storage_data[item.storage_index].file, []).append(item)
        buffer = bytearray(_BUFFER_BYTES)
        for name, items in per_file.items():
            path = self.directory / name
            with self.files.open_file(path) as file:
                for item in items:
                    stored = self.storage_data[item.storage_index]
                    try:
                        _read_box(file, stored.entry, stored.data_start, item, planner,
                                  buffer)
                    except EOFError as exc:
                        raise CheckpointError(f"{path}: {exc}; copy or download it "
                                              "again") from exc
        done: Future[None] = Future()
        done.set_result(None)
        return done


def _checked_header(file: IO[bytes], path: Any) -> tuple[dict[str, Any], int]:
    """The header of the safetensors file ``file`` and where its data starts, once checked
    as the safetensors library checks it: every tensor's bytes lie in the data, which they
    fill exactly, one after another.

    Raises:
        CheckpointError: naming ``path``, if it is not such a file or holds a dtype this
            reader does not read.
    """
    try:
        header, data_start = _header(file)
        problem = _header_problem(header, file.seek(0, 2) - data_start)
    except (ValueError, RecursionError) as exc:
        problem = str(exc)
    if problem is not None:
        raise CheckpointError(f"{path} is not a readable safetensors file ({problem}): it is "
                              "truncated or damaged; copy or download it again")
    for key, entry in header.items():
        if key != "__metadata__" and entry["dtype"] not in _DTYPES:
            raise CheckpointError(
                f"{path} holds {key} as {entry['dtype']}, a dtype this reader does not read "
                f"(it reads {', '.join(_DTYPES)}): convert the file's tensors to one of those")
    return header, data_start


def _header_problem(header: Any, data_bytes: int) -> str | None:
    """What makes ``header`` not the header of ``data_bytes`` of tensor data, or None."""
    if not isinstance(header, dict):
        return "its header is not a JSON object"
    extra = header.get("__metadata__", {})
    if not (isinstance(extra, dict) and all(isinstance(value, str) for value in extra.values())):
        return "its __metadata__ is not an object of strings"
    spans = []
    for key, entry in header.items():
        if key == "__metadata__":
            continue
        if not (isinstance(entry, dict) and isinstance(entry.get("dtype"), str)
                and isinstance(entry.get("shape"), list)
                and _is_offset(entry["shape"], len(entry["shape"]))
                and _is_offset(entry.get("data_offsets"), 2)
                and entry["data_offsets"][0] <= entry["data_offsets"][1]):
            return f"the entry of {key!r} lacks a dtype, shape or data_offsets"
        begin, end = entry["data_offsets"]
        dtype = _DTYPES.get(entry["dtype"])
        if dtype is not None and end - begin != math.prod(entry["shape"]) * dtype.itemsize:
            return f"{key!r} takes {end - begin} bytes, not those of its shape and dtype"
        spans.append((begin, end))
    position = 0
    for begin, end in sorted(spans):
        if begin != position:
            return f"its tensors leave a gap or overlap at byte {position} of the data"
        position = end
    if position != data_bytes:
        return f"its tensors need {position} bytes of data, the file holds {data_bytes}"
    return None


def _placement(extra: dict[str, str], header: dict[str, Any],
               path: Any) -> dict[str, list[int]]:
    """Where each tensor of the file sits in the whole tensor, by ``DCP_SHARDING_INFO``
    (none: the file holds whole tensors).

    Raises:
        CheckpointError: naming the file, if the entry does not place every tensor.
    """
    if _SHARDING_INFO not in extra:
        return {}
    try:
        sharding = json.loads(extra[_SHARDING_INFO])
        placed = {key: sharding[key][_OFFSETS] for key in header}
        valid = all(_is_offset(offsets, len(header[key]["shape"]))
                    for key, offsets in placed.items())
    except (ValueError, TypeError, KeyError, RecursionError):
        valid = False
    if not valid:
        raise CheckpointError(
            f"{path} has a {_SHARDING_INFO} entry in its metadata that does not give every "
            f"tensor's {_OFFSETS} (one non-negative integer per dimension): the file was "
            "altered or written by another tool; remove the entry if the file holds whole "
            "tensors")
    return placed


def _is_offset(offsets: Any, dims: int) -> bool:
    return isinstance(offsets, list) and len(offsets) == dims and all(
        type(offset) is int and offset >= 0 for offset in offsets)


def _check_coverage(fqn: str, entry: TensorStorageMetadata, metadata: Metadata,
                    directory: Any) -> None:
    """Refuse a tensor whose chunks do not cover it exactly once: an element no chunk holds
    would keep what its target held before the load (uninitialized memory, NaN).

    Raises:
        CheckpointError: naming the tensor and the files that hold its chunks.
    """
    boxes = [(chunk.offsets, chunk.sizes) for chunk in entry.chunks]
    size = tuple(entry.size)
    problem = tiling_problem(size, boxes)
    if problem is None:
        return
    names = sorted({metadata.storage_data[MetadataIndex(fqn, list(offsets))].file
                    for offsets, _ in boxes})
    files = ", ".join(str(directory / name) for name in names[:_SHOWN])
    shown = [(tuple(offsets), tuple(sizes)) for offsets, sizes in boxes[:_SHOWN]]
    more = f" and {len(boxes) - _SHOWN} more" if len(boxes) > _SHOWN else ""
    raise CheckpointError(
        f"the chunks of tensor {fqn!r} {list(size)} in {files}"
        f"{f' and {len(names) - _SHOWN} more files' if len(names) > _SHOWN else ''} "
        f"{problem} (offsets and sizes: {shown}{more}): loading them would leave elements of "
        f"the model unset. A file is missing or its {_SHARDING_INFO} is wrong; copy the "
        "complete directory")


def _header(file: IO[bytes]) -> tuple[Any, int]:
    """The safetensors header of ``file`` (key -> dtype, shape, data offsets; unchecked) and
    where the data starts.

    Raises:
        ValueError: if the file is too short for its header, or the header is not JSON.
    """
    file.seek(0)
    prefix = file.read(8)
    if len(prefix) < 8:
        raise ValueError(f"{len(prefix)} bytes, shorter than a header")
    (length,) = struct.unpack("<Q", prefix)
    if length > _MAX_HEADER_BYTES:
        raise ValueError(f"a header of {length} bytes, more than the format allows")
    text = file.read(length)
    if len(text) < length:
        raise ValueError(f"a header of {length} bytes in a file of {8 + len(text)}")
    try:
        return json.loads(text), 8 + length
    except ValueError as exc:  # not JSON, or not UTF-8
        raise ValueError(f"its header is not JSON: {exc}") from exc


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
                raise EOFError("the file ends inside tensor data: it is truncated")
            flat[written:written + count].copy_(torch.frombuffer(buffer, dtype=dtype,
                                                                 count=count))
            written += count
            remaining -= count
            position += count * element
    if not direct:
        target.copy_(flat.view(target.shape))
    planner.commit_tensor(item, target)


class BoxPlanner(DefaultLoadPlanner):
    """DCP's load planner, which also reads the ``boxes`` (storage key -> box) of file
    tensors into their targets: only the elements a box covers are read."""

    def __init__(self, boxes: Mapping[str, Box]) -> None:
        super().__init__()
        self.boxes = dict(boxes)

    def create_local_plan(self) -> LoadPlan:
        plan = super().create_local_plan()
        stored = self.metadata.state_dict_metadata  # type: ignore[union-attr]
        items = [item for key, (offsets, target) in self.boxes.items()
                 for item in create_read_items_for_chunk_list(
                     key, stored[key],  # type: ignore[arg-type]
                     [ChunkStorageMetadata(offsets=torch.Size(offsets),
                                           sizes=target.shape)])]
        return dataclasses.replace(plan, items=[*plan.items, *items])

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        box = self.boxes.get(read_item.dest_index.fqn)
        if box is None:
            return super().resolve_tensor(read_item)
        target = box[1]
        for dim, (offset, length) in enumerate(zip(read_item.dest_offsets, read_item.lengths)):
            target = target.narrow(dim, offset, length)
        return target
