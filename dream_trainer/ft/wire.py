"""The bytes of the state a recovering replica group copies from a peer: no pickle.

A payload is ``MAGIC``, the header's length (8 bytes, little-endian), the header (UTF-8
JSON) and the tensors' bytes, each at an offset aligned to ``ALIGN``. The header is the
array ``[tensors, tree]``: ``tensors`` holds ``[dtype, shape, offset]`` per tensor, and
``tree`` the state with every value tagged, so that decoding builds only these types:

- a str, int, bool or None as itself; ``["f", float.hex()]`` a float (nan and inf too);
- ``["d", [[key, value], ...]]`` a dict (keys of any type here: optimizers key by int);
- ``["l", [...]]`` a list, ``["t", [...]]`` a tuple, ``["b", base64]`` bytes;
- ``["T", index]`` a tensor of the table;
- ``["S", tensor, placements, shape, stride, mesh_dims, on_accelerator]`` a DTensor's shard
  (``Sharded``), each placement one of ``["shard", dim]``, ``["strided_shard", dim,
  split_factor]``, ``["replicate"]`` or ``["partial", reduce_op]``.

The reader refuses anything else, a header over ``MAX_HEADER_BYTES``, nesting deeper than
``MAX_DEPTH``, tensors that overlap or overrun the payload, and dicts whose keys were chosen
to share a hash (``guarded_dict``).
"""

from __future__ import annotations

import base64
import binascii
import ctypes
import json
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, NoReturn

import torch

from dream_trainer.ft.transfer import Sharded
from dream_trainer.utils.hash_guard import HashFloodError, guarded_dict

MAGIC = b"DTFT\x00\x00\x00\x01"
"""The first bytes of every payload (the last one is the format's version)."""
ALIGN = 64
"""Every tensor starts at a multiple of this offset (its bytes can be viewed as any dtype)."""
MAX_HEADER_BYTES = 64 * 2**20
"""Largest header read; a real one takes about 100 bytes per tensor."""
MAX_DEPTH = 64
"""Deepest nesting of containers read; a trainer's state is about 6 deep."""
_PREFIX = len(MAGIC) + 8

_DTYPES = {str(dtype).removeprefix("torch."): dtype for dtype in (
    torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn,
    torch.float8_e5m2, torch.complex64, torch.complex128, torch.int64, torch.int32,
    torch.int16, torch.int8, torch.uint8, torch.bool)}
_REDUCE_OPS = frozenset({"sum", "avg", "max", "min"})


class WireError(ValueError):
    """A payload is not a state this format can hold (malformed, crafted or too large)."""


@dataclass(frozen=True)
class Encoded:
    """A state ready to send: its header, the tensors it refers to, and its size."""

    header: bytes
    tensors: tuple[torch.Tensor, ...]
    nbytes: int

    def chunks(self) -> Iterator[bytes | memoryview]:
        """The payload's bytes in order, a tensor at a time (copied to the CPU when it lives
        elsewhere, one at a time)."""
        start = _data_start(len(self.header))
        yield MAGIC + len(self.header).to_bytes(8, "little") + self.header \
            + bytes(start - _PREFIX - len(self.header))
        position = 0
        for tensor in self.tensors:
            padding = -position % ALIGN
            if padding:
                yield bytes(padding)
            flat = tensor.detach().to("cpu").resolve_conj().resolve_neg().contiguous()
            nbytes = flat.numel() * flat.element_size()
            if nbytes:
                # A view of the tensor's memory, without a copy: ``flat`` stays alive in this
                # frame while the caller writes the view out.
                yield memoryview((ctypes.c_ubyte * nbytes).from_address(flat.data_ptr()))
            position += padding + nbytes


def encode(tree: Any) -> Encoded:
    """``tree`` (what ``to_wire`` made) in this format; tensors are referred to, not copied.

    Raises:
        TypeError: naming the first value of a type the format cannot hold, and where it is.
    """
    tensors: list[torch.Tensor] = []
    body = _Writer(tensors).node(tree, ("state",))
    offsets, end = _layout(tensors)
    header = _dumps([[[_dtype_name(t), list(t.shape), offset]
                      for t, offset in zip(tensors, offsets)], body])
    return Encoded(header, tuple(tensors), _data_start(len(header)) + end)


def decode(payload: bytearray | memoryview, source: str) -> Any:
    """The state that ``payload`` holds, built only from the types this format allows.

    Args:
        payload: The whole payload, already authenticated where a secret is in use
            (writable: its tensors are copied out of it without a read-only copy first).
        source: Where it came from, for the errors.

    Raises:
        WireError: naming ``source`` and what is wrong (a pickle, for one, is refused by its
            first bytes: it does not start with ``MAGIC``).
    """
    view = memoryview(payload)
    if len(view) < _PREFIX or bytes(view[:len(MAGIC)]) != MAGIC:
        _refuse(source, f"it does not start with this format's marker {MAGIC!r} (a pickle, "
                        "another program's answer, or another version of dream_trainer)")
    size = int.from_bytes(view[len(MAGIC):_PREFIX], "little")
    if size > MAX_HEADER_BYTES or _data_start(size) > len(view):
        _refuse(source, f"its header claims {size} bytes, over the {MAX_HEADER_BYTES} read or "
                        f"the {len(view) - _PREFIX} sent")
    try:
        header = json.loads(bytes(view[_PREFIX:_PREFIX + size]).decode("utf-8"),
                            object_pairs_hook=_no_objects, parse_float=_no_float,
                            parse_constant=_no_float)
    except RecursionError:
        _refuse(source, f"its header nests deeper than {MAX_DEPTH} levels")
    except (UnicodeDecodeError, ValueError) as exc:
        _refuse(source, f"its header is not this format's JSON ({exc})")
    if not (isinstance(header, list) and len(header) == 2 and isinstance(header[0], list)):
        _refuse(source, "its header is not the array [tensors, tree]")
    tensors = _read_tensors(header[0], view[_data_start(size):], source)
    return _Reader(tensors, source).node(header[1], ("state",))


# -- writing ---------------------------------------------------------------------------------
class _Writer:
    def __init__(self, tensors: list[torch.Tensor]) -> None:
        self.tensors = tensors
        self.index: dict[int, int] = {}

    def node(self, value: Any, path: tuple[str, ...]) -> Any:
        if len(path) > MAX_DEPTH:
            raise TypeError(f"{_where(path)} nests deeper than {MAX_DEPTH} levels (a cycle?)")
        if value is None or isinstance(value, (bool, str)):
            return value
        if isinstance(value, int):
            return int(value)
        if isinstance(value, float):
            return ["f", float(value).hex()]
        if isinstance(value, torch.Tensor):
            return ["T", self.tensor(value, path)]
        if isinstance(value, Sharded):
            return ["S", ["T", self.tensor(value.local, path)],
                    [_placement(p, path) for p in value.placements], list(value.shape),
                    list(value.stride), list(value.mesh_dims), bool(value.on_accelerator)]
        if isinstance(value, dict):
            return ["d", [[self.node(key, (*path, f"key {key!r}")),
                           self.node(item, (*path, repr(key)))]
                          for key, item in value.items()]]
        if isinstance(value, (list, tuple)):
            return ["l" if isinstance(value, list) else "t",
                    [self.node(item, (*path, str(i))) for i, item in enumerate(value)]]
        if isinstance(value, (bytes, bytearray)):
            return ["b", base64.b64encode(bytes(value)).decode("ascii")]
        raise TypeError(
            f"{_where(path)} is a {type(value).__module__}.{type(value).__qualname__}, which a "
            "recovering replica group cannot receive: the live state travels as tensors, "
            "dicts, lists, tuples, str, bytes, int, float, bool and None only; keep such a "
            "value out of state_dict() (or store it as one of those types)")

    def tensor(self, value: torch.Tensor, path: tuple[str, ...]) -> int:
        # One entry per tensor object: tied weights arrive tied, and are sent once.
        if id(value) in self.index:
            return self.index[id(value)]
        name = _dtype_name(value)
        if name not in _DTYPES or value.layout != torch.strided \
                or type(value) not in (torch.Tensor, torch.nn.Parameter):
            raise TypeError(f"{_where(path)} is a {type(value).__name__} of dtype {name} and "
                            f"layout {value.layout}, which a recovering replica group cannot "
                            "receive: only dense tensors of the dtypes "
                            f"{', '.join(sorted(_DTYPES))}")
        self.index[id(value)] = len(self.tensors)
        self.tensors.append(value)
        return self.index[id(value)]


def _placement(placement: Any, path: tuple[str, ...]) -> list[Any]:
    from torch.distributed.tensor import Partial, Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    if type(placement) is Shard:
        return ["shard", int(placement.dim)]
    if type(placement) is _StridedShard:
        return ["strided_shard", int(placement.dim), int(placement.split_factor)]
    if type(placement) is Replicate:
        return ["replicate"]
    if type(placement) is Partial and placement.reduce_op in _REDUCE_OPS:
        return ["partial", str(placement.reduce_op)]
    raise TypeError(f"{_where(path)} is a DTensor placed by {placement!r}, which a recovering "
                    "replica group cannot receive")


def _layout(tensors: list[torch.Tensor]) -> tuple[list[int], int]:
    """Each tensor's offset from the start of the data, and where the data ends."""
    offsets, position = [], 0
    for tensor in tensors:
        position += -position % ALIGN
        offsets.append(position)
        position += tensor.numel() * tensor.element_size()
    return offsets, position


def _data_start(header_size: int) -> int:
    end = _PREFIX + header_size
    return end + -end % ALIGN


def _dtype_name(tensor: torch.Tensor) -> str:
    return str(tensor.dtype).removeprefix("torch.")


def _dumps(value: Any) -> bytes:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=True,
                      allow_nan=False).encode("ascii")


def _where(path: tuple[str, ...]) -> str:
    return path[0] + "".join(f"[{part}]" for part in path[1:])


# -- reading ---------------------------------------------------------------------------------
def _read_tensors(table: list[Any], data: memoryview, source: str) -> list[torch.Tensor]:
    """Each tensor of the table, copied out of the payload (views would keep every byte of
    it alive as long as any one tensor, an optimizer's state say, is kept)."""
    tensors, position = [], 0
    for i, entry in enumerate(table):
        if not (isinstance(entry, list) and len(entry) == 3 and entry[0] in _DTYPES
                and _int_list(entry[1]) and all(0 <= d < 2**62 for d in entry[1])
                and _is_int(entry[2])):
            _refuse(source, f"tensor {i} of its table is not [dtype, shape, offset] with a "
                            f"dtype among {sorted(_DTYPES)}")
        dtype, shape, offset = _DTYPES[entry[0]], entry[1], entry[2]
        nbytes = math.prod(shape) * dtype.itemsize
        if offset < position or offset % ALIGN or offset + nbytes > len(data):
            _refuse(source, f"tensor {i} lies at bytes {offset} to {offset + nbytes} of the "
                            f"data, which overlap the previous tensor, are unaligned or run "
                            f"past the {len(data)} bytes sent")
        tensor = torch.empty(shape, dtype=dtype)
        if nbytes:
            raw = tensor.reshape(-1).view(torch.uint8)
            raw.copy_(torch.frombuffer(data, dtype=torch.uint8, count=nbytes, offset=offset))
            if dtype == torch.bool and bool((raw > 1).any()):
                _refuse(source, f"tensor {i} is a bool tensor holding bytes other than 0 "
                                "and 1")
        tensors.append(tensor)
        position = offset + nbytes
    if position != len(data):
        _refuse(source, f"its tensors end at byte {position} of the data but {len(data)} "
                        "were sent")
    return tensors


class _Reader:
    def __init__(self, tensors: list[torch.Tensor], source: str) -> None:
        self.tensors, self.source = tensors, source

    def node(self, node: Any, path: tuple[str, ...]) -> Any:
        if node is None or isinstance(node, (bool, int, str)):
            return node
        if len(path) > MAX_DEPTH:
            self.refuse(path, f"nests deeper than {MAX_DEPTH} levels")
        if not (isinstance(node, list) and node and isinstance(node[0], str)):
            self.refuse(path, "is neither a scalar nor a tagged value")
        tag, args = node[0], node[1:]
        if tag == "f" and len(args) == 1 and isinstance(args[0], str):
            try:
                return float.fromhex(args[0])
            except ValueError:
                self.refuse(path, f"is not a float: {args[0][:40]!r}")
        if tag in ("l", "t") and len(args) == 1 and isinstance(args[0], list):
            items = [self.node(item, (*path, str(i))) for i, item in enumerate(args[0])]
            return items if tag == "l" else tuple(items)
        if tag == "d" and len(args) == 1 and isinstance(args[0], list):
            return self.dict(args[0], path)
        if tag == "b" and len(args) == 1 and isinstance(args[0], str):
            try:
                return base64.b64decode(args[0], validate=True)
            except binascii.Error:
                self.refuse(path, "is not base64")
        if tag == "T" and len(args) == 1 and _is_int(args[0]) \
                and 0 <= args[0] < len(self.tensors):
            return self.tensors[args[0]]
        if tag == "S" and len(args) == 6:
            return self.sharded(args, path)
        self.refuse(path, f"is not a value of this format (tag {tag[:10]!r})")

    def dict(self, pairs: list[Any], path: tuple[str, ...]) -> dict[Any, Any]:
        built = []
        for pair in pairs:
            if not (isinstance(pair, list) and len(pair) == 2):
                self.refuse(path, "holds an entry that is not a [key, value] pair")
            key = self.node(pair[0], (*path, "key"))
            built.append((key, self.node(pair[1], (*path, repr(key)[:60]))))
        try:
            result = guarded_dict(built, f"the dict at {_where(path)} sent by {self.source}")
        except HashFloodError as exc:
            raise WireError(str(exc)) from exc
        except TypeError:
            self.refuse(path, "has a key that is not hashable (a list or a dict)")
        if len(result) != len(built):
            self.refuse(path, "repeats a key")
        return result

    def sharded(self, args: list[Any], path: tuple[str, ...]) -> Sharded:
        local = self.node(args[0], (*path, "local"))
        placements, shape, stride, dims, on_accelerator = args[1:]
        if not (isinstance(local, torch.Tensor) and isinstance(placements, list)
                and _int_list(shape) and _int_list(stride) and isinstance(dims, list)
                and all(isinstance(d, str) for d in dims) and isinstance(on_accelerator, bool)
                and len(placements) == len(dims) and len(shape) == len(stride) == local.dim()):
            self.refuse(path, "is not a sharded tensor: [tensor, placements, shape, stride, "
                              "mesh_dims, on_accelerator] with one placement per mesh "
                              "dimension")
        return Sharded(local, tuple(self.placement(p, path) for p in placements),
                       torch.Size(shape), tuple(stride), tuple(dims), on_accelerator)

    def placement(self, node: Any, path: tuple[str, ...]) -> Any:
        from torch.distributed.tensor import Partial, Replicate, Shard
        from torch.distributed.tensor.placement_types import _StridedShard

        if node == ["replicate"]:
            return Replicate()
        if isinstance(node, list) and len(node) == 2 and node[0] == "shard" \
                and _is_int(node[1]) and 0 <= node[1] < MAX_DEPTH:
            return Shard(node[1])
        if isinstance(node, list) and len(node) == 3 and node[0] == "strided_shard" \
                and _int_list(node[1:]) and 0 <= node[1] < MAX_DEPTH and node[2] > 0:
            return _StridedShard(node[1], split_factor=node[2])
        if isinstance(node, list) and len(node) == 2 and node[0] == "partial" \
                and node[1] in _REDUCE_OPS:
            return Partial(node[1])
        self.refuse(path, f"has a placement that is not Shard, Replicate or Partial: "
                          f"{str(node)[:60]}")

    def refuse(self, path: tuple[str, ...], problem: str) -> NoReturn:
        _refuse(self.source, f"{_where(path)} {problem}")


def _refuse(source: str, problem: str) -> NoReturn:
    raise WireError(f"the state sent by {source} is refused: {problem}")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _int_list(value: Any) -> bool:
    return isinstance(value, list) and len(value) <= MAX_DEPTH and all(map(_is_int, value))


def _no_objects(pairs: list[tuple[str, Any]]) -> NoReturn:
    raise ValueError("a JSON object, which this format never writes")


def _no_float(text: str) -> NoReturn:
    raise ValueError(f"an untagged number {text[:20]!r}, which this format never writes")
