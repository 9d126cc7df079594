"""Reading a rank's slices of safetensors files with plain reads, not a memory map.

DCP's ``HuggingFaceStorageReader`` slices each tensor out of safetensors' memory map. Every
page a rank touches then stays mapped, and counted in its resident memory, until the file is
closed, which for a model saved as one file is the end of the load: a rank that reads half
of every tensor holds half the file in mapped pages on top of its own shards. This reader
keeps DCP's planning and metadata and reads each requested box with ordinary reads through
one bounded buffer, straight into the rank's shard.

Before any read it checks what DCP's reader takes on trust: every file opens as safetensors
and holds only dtypes this reader knows, and the chunks of every tensor (several files may
each hold a part, placed by their ``DCP_SHARDING_INFO``) cover it exactly once. With the
shapes matched to the model's (``PretrainedWeights``), every element of every target tensor
is then written by the load.
"""

from __future__ import annotations

import itertools
import json
import math
import struct
from pathlib import Path
from typing import IO, Any

import torch
from torch.distributed.checkpoint import HuggingFaceStorageReader
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner, ReadItem
from torch.futures import Future

from dream_trainer.errors import CheckpointError

_BUFFER_BYTES = 16 * 2**20
_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16,
           "BF16": torch.bfloat16, "I64": torch.int64, "I32": torch.int32, "I16": torch.int16,
           "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool,
           "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}


_SHARDING_INFO = "DCP_SHARDING_INFO"  # torch's key for where a file's chunk of a tensor sits
_OFFSETS = "saved_offsets"


class SliceReader(HuggingFaceStorageReader):
    """``HuggingFaceStorageReader`` whose reads go through a 16 MiB buffer, not a map."""

    def read_metadata(self) -> Metadata:
        """The tensors of the directory's safetensors files and where their chunks lie.

        Raises:
            CheckpointError: naming the file that is damaged or truncated, holds a dtype
                this reader cannot read or a malformed ``DCP_SHARDING_INFO``; or the tensor
                whose chunks leave elements unwritten or overlap, and its files.
        """
        for file in sorted(Path(self.path).glob("*.safetensors")):
            _check_file(file)
        try:
            metadata = super().read_metadata()
        except (ValueError, TypeError, KeyError, IndexError) as exc:
            raise CheckpointError(f"cannot read the safetensors files of {self.path}: "
                                  f"{type(exc).__name__}: {exc}") from exc
        for fqn, entry in metadata.state_dict_metadata.items():
            _check_coverage(fqn, entry, metadata)
        return metadata

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


def _check_file(file: Path) -> None:
    """Refuse a safetensors file that does not open, holds an unknown dtype, or whose
    ``DCP_SHARDING_INFO`` does not place each of its tensors.

    Raises:
        CheckpointError: naming the file and the problem.
    """
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(file), framework="pt") as handle:
            tensors = {key: handle.get_slice(key) for key in handle.keys()}
            shapes = {key: tensor.get_shape() for key, tensor in tensors.items()}
            dtypes = {key: tensor.get_dtype() for key, tensor in tensors.items()}
            extra = handle.metadata() or {}
    except (SafetensorError, OSError) as exc:
        raise CheckpointError(f"{file} is not a readable safetensors file ({exc}): it is "
                              "truncated or damaged; copy or download it again") from exc
    for key, dtype in dtypes.items():
        if dtype not in _DTYPES:
            raise CheckpointError(
                f"{file} holds {key} as {dtype}, a dtype this reader does not read (it reads "
                f"{', '.join(_DTYPES)}): convert the file's tensors to one of those")
    if _SHARDING_INFO not in extra:
        return
    try:
        sharding = json.loads(extra[_SHARDING_INFO])
        placed = all(_is_offset(sharding[key][_OFFSETS], len(shape))
                     for key, shape in shapes.items())
    except (ValueError, TypeError, KeyError, RecursionError):
        placed = False
    if not placed:
        raise CheckpointError(
            f"{file} has a {_SHARDING_INFO} entry in its metadata that does not give every "
            f"tensor's {_OFFSETS} (one non-negative integer per dimension): the file was "
            "altered or written by another tool; remove the entry if the file holds whole "
            "tensors")


def _is_offset(offsets: Any, dims: int) -> bool:
    return isinstance(offsets, list) and len(offsets) == dims and all(
        type(offset) is int and offset >= 0 for offset in offsets)


def _check_coverage(fqn: str, entry: TensorStorageMetadata, metadata: Metadata) -> None:
    """Refuse a tensor whose chunks do not cover it exactly once: an element no chunk holds
    would keep what its target held before the load (uninitialized memory, NaN).

    The chunks cover it exactly when none overlap and their elements add up to its own.

    Raises:
        CheckpointError: naming the tensor and the files that hold its chunks.
    """
    boxes = [(tuple(chunk.offsets), tuple(chunk.sizes)) for chunk in entry.chunks]
    size = tuple(entry.size)
    if any(len(offsets) != len(size) or len(sizes) != len(size) for offsets, sizes in boxes):
        problem = "differ in their number of dimensions"
    elif any(_overlap(a, b) for a, b in itertools.combinations(boxes, 2)):
        problem = "overlap"
    else:
        covered, total = sum(math.prod(sizes) for _, sizes in boxes), math.prod(size)
        if covered == total:
            return
        problem = f"hold {covered} of its {total} elements"
    files = sorted({str(metadata.storage_data[MetadataIndex(fqn, list(offsets))].relative_path)
                    for offsets, _ in boxes})
    raise CheckpointError(
        f"the chunks of tensor {fqn!r} {list(size)} in {', '.join(files)} {problem} (offsets "
        f"and sizes: {boxes}): loading them would leave elements of the model unset. A file "
        f"is missing or its {_SHARDING_INFO} is wrong; copy the complete directory")


def _overlap(a: tuple[tuple[int, ...], tuple[int, ...]],
             b: tuple[tuple[int, ...], tuple[int, ...]]) -> bool:
    """Whether two non-empty boxes ``(offsets, sizes)`` share an element."""
    if 0 in a[1] or 0 in b[1]:
        return False
    return all(a_start < b_start + b_size and b_start < a_start + a_size
               for a_start, a_size, b_start, b_size in zip(a[0], a[1], b[0], b[1]))


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
