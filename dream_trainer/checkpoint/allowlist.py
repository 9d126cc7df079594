"""What a checkpoint's pickles may hold, and how the decoder builds each allowed value.

Each allowed global has a ``Name``: the builder ``REDUCE`` calls with the arguments, or the
builder ``BUILD`` calls with the state, each checking what it is given and making a fresh
value with the type's own constructor. ``.metadata`` may hold DCP's metadata classes; a
``torch.save`` archive (an item, or a value dream_trainer packed) containers, scalars and
tensors. Read off real checkpoints of every layout.
"""

from __future__ import annotations

import dataclasses
import pathlib
from collections import Counter, OrderedDict
from collections.abc import Callable, Mapping
from typing import Any

import torch

from dream_trainer.checkpoint.tensor_ref import TensorRef
from dream_trainer.utils.hash_guard import MAX_SHARED_HASH, HashFloodError, count_keys
from dream_trainer.utils.paths import component_problem


class Refusal(Exception):
    """What the decoder refuses, without the file name (the caller adds it)."""


# -- names ----------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Name:
    """What ``GLOBAL`` pushes: an allowed name and how to build from it.

    Attributes:
        reduce: ``REDUCE``'s builder: the arguments tuple -> a fresh value.
        build: ``NEWOBJ`` then ``BUILD``'s builder: the state -> a fresh instance.
        empty: ``NEWOBJ`` without ``BUILD`` (a class without fields) -> a fresh instance.
        newobj: ``NEWOBJ`` with arguments (a named tuple) -> a fresh value.
        trusted: A user's trusted class or function, unpickled the standard way.
        dtype: For a storage class of a ``torch.save`` archive, its element type.
        bounded: ``reduce`` reads a bounded number of values whatever its arguments hold
            (it refuses a longer tuple before reading it), so the decoder does not charge
            their expansion (``checkpoint.budget``).
    """

    name: str
    reduce: Callable[[tuple[Any, ...]], Any] | None = None
    build: Callable[[Any], Any] | None = None
    empty: Callable[[], Any] | None = None
    newobj: Callable[[tuple[Any, ...]], Any] | None = None
    trusted: Any = None
    dtype: torch.dtype | None = None
    bounded: bool = False


class ViewBytes:
    """The bytes of tensor views one archive may still yield: a view can be far larger than
    its storage (stride 0), and whatever reads it afterwards (a copy to a device, a hash)
    pays for its size, not its storage's."""

    __slots__ = ("left", "limit", "size")

    def __init__(self, limit: int, size: int) -> None:
        self.left = self.limit = limit
        self.size = size

    def charge(self, nbytes: int) -> None:
        """Count ``nbytes`` more of views.

        Raises:
            Refusal: once the views yielded exceed the limit.
        """
        self.left -= nbytes
        if self.left < 0:
            raise Refusal(f"tensor views of more than {self.limit} bytes from an archive of "
                          f"{self.size} bytes (views of one storage repeated, or stretched "
                          "with stride 0, far beyond what it holds)")


@dataclasses.dataclass(frozen=True)
class Storage:
    """A ``torch.save`` archive's storage, as its persistent id names it, and the archive's
    tally of view bytes."""

    data: torch.UntypedStorage
    dtype: torch.dtype
    views: ViewBytes | None = None


# -- checks shared by the builders ----------------------------------------------------------
def as_int(value: Any, what: str, minimum: int | None = 0) -> int:
    if type(value) is not int or (minimum is not None and value < minimum):
        raise Refusal(f"{what} must be an integer >= {minimum}, got {_describe(value)}")
    return value


def as_str(value: Any, what: str) -> str:
    if type(value) is not str:
        raise Refusal(f"{what} must be a string, got {_describe(value)}")
    return value


def _bool(value: Any, what: str) -> bool:
    if type(value) is not bool:
        raise Refusal(f"{what} must be True or False, got {_describe(value)}")
    return value


def _optional(check: Callable[[Any, str], Any]) -> Callable[[Any, str], Any]:
    return lambda value, what: None if value is None else check(value, what)


def _size(value: Any, what: str) -> torch.Size:
    if not isinstance(value, tuple) or len(value) > 64 or not set(map(type, value)) <= {int} \
            or (value and min(value) < 0):
        raise Refusal(f"{what} must be a tuple of at most 64 sizes >= 0, got "
                      f"{_describe(value)}")
    return torch.Size(value)


def _describe(value: Any) -> str:
    text = repr(value) if isinstance(value, (int, float, bool, type(None))) else ""
    return f"{type(value).__name__} {text[:40]}".rstrip()


def _args(args: tuple[Any, ...], count: int | tuple[int, ...], name: str) -> tuple[Any, ...]:
    counts = (count,) if isinstance(count, int) else count
    if len(args) not in counts:
        raise Refusal(f"{name} takes {' or '.join(map(str, counts))} arguments, got "
                      f"{len(args)}")
    return args


# -- builders: plain torch and Python values ------------------------------------------------
def _torch_size(args: tuple[Any, ...]) -> torch.Size:
    (sizes,) = _args(args, 1, "torch.Size")
    return _size(sizes, "torch.Size")


def _layout(args: tuple[Any, ...]) -> torch.layout:
    (name,) = _args(args, 1, "torch.serialization._get_layout")
    layout = getattr(torch, as_str(name, "a layout").removeprefix("torch."), None)
    if not isinstance(layout, torch.layout):
        raise Refusal(f"{name!r} is not a torch layout")
    return layout


def _encode(args: tuple[Any, ...]) -> bytes:
    # Protocol 2 (torch.save's) writes bytes as _codecs.encode(text, "latin1").
    text, encoding = _args(args, 2, "_codecs.encode")
    if encoding not in ("latin1", "latin-1"):
        raise Refusal(f"_codecs.encode with encoding {_describe(encoding)}")
    return as_str(text, "_codecs.encode's text").encode("latin1")


def _bytearray(args: tuple[Any, ...]) -> bytearray:
    if not args:
        return bytearray()
    if len(args) == 1 and isinstance(args[0], bytes):
        return bytearray(args[0])
    return bytearray(_encode(_args(args, 2, "bytearray")))


def _complex(args: tuple[Any, ...]) -> complex:
    real, imag = _args(args, 2, "complex")
    if type(real) is not float or type(imag) is not float:
        raise Refusal("complex takes two floats")
    return complex(real, imag)


def _device(args: tuple[Any, ...]) -> torch.device:
    _args(args, (1, 2), "torch.device")
    kind = as_str(args[0], "a device type")
    index = as_int(args[1], "a device index") if len(args) == 2 else None
    try:
        return torch.device(kind) if index is None else torch.device(kind, index)
    except RuntimeError as exc:
        raise Refusal(f"{kind!r} is not a device: {exc}") from exc


def _path(flavour: type[pathlib.PurePath]) -> Callable[[tuple[Any, ...]], pathlib.PurePath]:
    # A pure path: the file may say what a path was, not make this process touch it.
    def build(args: tuple[Any, ...]) -> pathlib.PurePath:
        if len(args) > 4096:
            raise Refusal(f"a path of {len(args)} parts")
        return flavour(*(as_str(part, "a path part") for part in args))
    return build


def _ordered_dict(args: tuple[Any, ...]) -> OrderedDict[Any, Any]:
    # The items follow as SETITEMS, through the key count of _SafeUnpickler.
    _args(args, 0, "collections.OrderedDict")
    return OrderedDict()


# -- builders: tensors of a torch.save archive ----------------------------------------------
def _rebuild_tensor(args: tuple[Any, ...]) -> torch.Tensor:
    _args(args, (6, 7), "torch._utils._rebuild_tensor_v2")
    return _tensor(args[0], args[0].dtype if isinstance(args[0], Storage) else None, *args[1:])


def _rebuild_tensor_v3(args: tuple[Any, ...]) -> torch.Tensor:
    # torch.save's form for dtypes without a typed storage class (uint16, float8, ...).
    _args(args, (7, 8), "torch._utils._rebuild_tensor_v3")
    storage, offset, size, stride, requires_grad, hooks, dtype = args[:7]
    _instance(torch.dtype)(dtype, "a tensor's dtype")
    return _tensor(storage, dtype, offset, size, stride, requires_grad, hooks, *args[7:])


def _tensor(storage: Any, dtype: torch.dtype | None, offset: Any, size: Any, stride: Any,
            requires_grad: Any, hooks: Any, metadata: Any = None) -> torch.Tensor:
    if not isinstance(storage, Storage) or dtype is None:
        raise Refusal("a tensor must be rebuilt from the archive's own storage")
    if hooks or metadata:
        raise Refusal("a tensor with backward hooks or metadata")
    offset = as_int(offset, "a storage offset")
    size, stride = _size(size, "a tensor size"), _size(stride, "a tensor stride")
    if len(size) != len(stride):
        raise Refusal(f"a tensor of size {tuple(size)} with stride {tuple(stride)}")
    elements = storage.data.nbytes() // dtype.itemsize
    last = offset + sum((dim - 1) * step for dim, step in zip(size, stride)) \
        if all(size) else offset - 1
    if last >= elements:
        raise Refusal(f"a tensor view (offset {offset}, size {tuple(size)}, stride "
                      f"{tuple(stride)}) reaches past its storage of {elements} elements")
    if storage.views is not None:
        storage.views.charge(size.numel() * dtype.itemsize)
    tensor = torch.empty(0, dtype=dtype)
    tensor.set_(storage.data, offset, size, stride)
    return tensor.requires_grad_(_bool(requires_grad, "requires_grad")
                                 and tensor.is_floating_point())


def _rebuild_parameter(args: tuple[Any, ...]) -> torch.nn.Parameter:
    data, requires_grad, hooks = _args(args, 3, "torch._utils._rebuild_parameter")
    if not isinstance(data, torch.Tensor) or hooks:
        raise Refusal("a parameter must hold a tensor and no hooks")
    return torch.nn.Parameter(data, _bool(requires_grad, "requires_grad"))


_WRAPPED_WEIGHTS = frozenset({"torchao.float8.fsdp_utils.WeightWithDynamicFloat8CastTensor"})
"""Tensor subclasses (float8 training's weights) that keep their data, a plain tensor, in
their state's ``_tensor``: a checkpoint gives back that tensor."""
_TENSOR_TYPES = frozenset({"torch.Tensor", "torch.nn.parameter.Parameter"})


def _rebuild_from_type(args: tuple[Any, ...]) -> torch.Tensor:
    """``torch._tensor._rebuild_from_type_v2(func, type, args, state)``: how torch.save
    writes a tensor with Python state or of a subclass. Nothing of it is called: a float8
    weight gives back the plain tensor its state holds; a plain tensor is rebuilt by the
    tensor builder and given its plain attributes back."""
    func, kind, inner, state = _args(args, 4, "torch._tensor._rebuild_from_type_v2")
    if not (isinstance(func, Name) and isinstance(kind, Name) and type(inner) is tuple
            and type(state) is dict):
        raise Refusal("torch._tensor._rebuild_from_type_v2 with arguments of other types")
    if kind.name in _WRAPPED_WEIGHTS:
        data = state.get("_tensor")
        if not isinstance(data, torch.Tensor):
            raise Refusal(f"a {kind.name} without its tensor")
        return data.detach()
    if kind.name not in _TENSOR_TYPES or func.reduce not in (_rebuild_tensor,
                                                             _rebuild_tensor_v3):
        raise Refusal(f"a tensor of type {kind.name} rebuilt by {func.name}")
    tensor = func.reduce(inner)
    for key, value in state.items():
        if type(key) is not str or not key.isidentifier() or key.startswith("__"):
            raise Refusal(f"a tensor attribute named {str(key)[:40]!r}")
        setattr(tensor, key, value)
    return tensor


def _plain_tuple(args: tuple[Any, ...]) -> tuple[Any, ...]:
    """A named tuple of settings kept beside a tensor (float8's matmul configs), read as a
    plain tuple: what it holds is never used, only decoded."""
    return args


# -- builders: DCP's metadata and dream_trainer's own records -------------------------------
def _fields(cls: type, checks: Mapping[str, Callable[[Any, str], Any]]) -> Callable[[Any], Any]:
    """A builder of ``cls`` from a state dict: every key a known field, every value checked
    (and copied), then ``cls``'s own constructor."""
    name = cls.__qualname__

    def build(state: Any) -> Any:
        if isinstance(state, tuple) and len(state) == 2 and state[0] is None:
            state = state[1]  # (no __dict__, slots): a slots dataclass
        if type(state) is not dict:
            raise Refusal(f"the state of {name} must be a dict, got {_describe(state)}")
        unknown = [key for key in state if key not in checks]
        if unknown:
            raise Refusal(f"{name} has no field {str(unknown[0])[:80]!r}")
        values = {key: checks[key](value, f"{name}.{key}") for key, value in state.items()}
        try:
            return cls(**values)
        except TypeError as exc:
            raise Refusal(f"{name}: {exc}") from exc
    return build


def _list_of(check: Callable[[Any, str], Any]) -> Callable[[Any, str], list[Any]]:
    def checked(value: Any, what: str) -> list[Any]:
        if type(value) is not list:
            raise Refusal(f"{what} must be a list, got {_describe(value)}")
        return [check(item, what) for item in value]
    return checked


def _instance(*types: type) -> Callable[[Any, str], Any]:
    def checked(value: Any, what: str) -> Any:
        if not isinstance(value, types):
            raise Refusal(f"{what} must be a {' or '.join(t.__name__ for t in types)}, got "
                          f"{_describe(value)}")
        return value
    return checked


def _file_name(value: Any, what: str) -> str:
    """DCP names its files ``__<rank>_<n>.distcp`` inside the checkpoint directory; a name
    that leaves it (``../x``, ``/etc/x``) would read a file no checksum covers."""
    problem = component_problem(value)
    if problem is not None:
        raise Refusal(f"{what} {str(value)[:1000]!r}, which {problem}: not a file name inside "
                      "the checkpoint")
    return value


def _planner_data(value: Any, what: str) -> dict[str, tuple[str | int, ...]] | None:
    """DCP's default planner keeps, per flattened key, the path of keys it came from."""
    if value is None:
        return None
    if type(value) is not dict:
        raise Refusal(f"{what} must be a dict, got {_describe(value)}")
    paths = {}
    for key, path in value.items():
        if type(path) not in (tuple, list) or not all(type(p) in (str, int) for p in path):
            raise Refusal(f"{what} must map names to paths of names and indices")
        paths[as_str(key, what)] = tuple(path)
    return paths


def _dcp_globals() -> dict[str, Name]:
    from torch.distributed.checkpoint import metadata as dcp
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    def properties(state: Any) -> Any:
        if not isinstance(state, tuple) or len(state) != 5:
            raise Refusal("the state of TensorProperties must be a 5-tuple")
        dtype, layout, requires_grad, memory_format, pin_memory = state
        _instance(torch.dtype)(dtype, "TensorProperties.dtype")
        _instance(torch.layout)(layout, "TensorProperties.layout")
        _instance(dcp._MEM_FORMAT_ENCODING)(memory_format, "TensorProperties.memory_format")
        fresh = dcp.TensorProperties.__new__(dcp.TensorProperties)
        # DCP's own decoding of the memory format, on values checked above.
        fresh.__setstate__((dtype, layout, _bool(requires_grad, "requires_grad"),
                            memory_format, _bool(pin_memory, "pin_memory")))
        return fresh

    def memory_format(args: tuple[Any, ...]) -> Any:
        (value,) = _args(args, 1, "_MEM_FORMAT_ENCODING")
        try:
            return dcp._MEM_FORMAT_ENCODING(as_int(value, "a memory format code"))
        except ValueError as exc:
            raise Refusal(str(exc)) from exc

    chunk = _fields(dcp.ChunkStorageMetadata, {"offsets": _size, "sizes": _size})
    prefix = "torch.distributed.checkpoint.metadata."
    return _table(
        Name(prefix + "Metadata", build=_fields(dcp.Metadata, {
            "state_dict_metadata": _dict_of(as_str, _instance(dcp.TensorStorageMetadata,
                                                              dcp.BytesStorageMetadata)),
            "planner_data": _planner_data,
            "storage_data": _optional(_dict_of(_instance(dcp.MetadataIndex),
                                               _instance(_StorageInfo))),
            "storage_meta": _optional(_instance(dcp.StorageMeta)),
            "version": _optional(as_str)})),
        Name(prefix + "TensorStorageMetadata", build=_fields(dcp.TensorStorageMetadata, {
            "properties": _instance(dcp.TensorProperties), "size": _instance(torch.Size),
            "chunks": _list_of(_instance(dcp.ChunkStorageMetadata))})),
        Name(prefix + "BytesStorageMetadata", empty=dcp.BytesStorageMetadata),
        Name(prefix + "ChunkStorageMetadata", build=chunk),
        Name(prefix + "TensorProperties", build=properties),
        Name(prefix + "MetadataIndex", build=_fields(dcp.MetadataIndex, {
            "fqn": as_str, "offset": _optional(_instance(torch.Size)),
            "index": _optional(as_int)})),
        Name(prefix + "StorageMeta", build=_fields(dcp.StorageMeta, {
            "checkpoint_id": _optional(_instance(str, pathlib.PurePath)),
            "save_id": _optional(as_str), "load_id": _optional(as_str),
            "modules": _list_of(as_str)})),
        Name(prefix + "_MEM_FORMAT_ENCODING", reduce=memory_format, bounded=True),
        Name("torch.distributed.checkpoint.filesystem._StorageInfo", build=_fields(_StorageInfo, {
            "relative_path": _file_name, "offset": as_int, "length": as_int,
            "transform_descriptors": _optional(_list_of(as_str))})),
    )


def _table(*names: Name) -> dict[str, Name]:
    return {name.name: name for name in names}


def _dict_of(keys: Callable[[Any, str], Any],
             values: Callable[[Any, str], Any]) -> Callable[[Any, str], dict[Any, Any]]:
    def checked(value: Any, what: str) -> dict[Any, Any]:
        if type(value) is not dict:
            raise Refusal(f"{what} must be a dict, got {_describe(value)}")
        return {keys(key, what): values(item, what) for key, item in value.items()}
    return checked


def _common_globals() -> dict[str, Name]:
    paths = [Name(f"pathlib.{name}", reduce=_path(flavour))
             for name, flavour in (("Path", pathlib.PurePosixPath),
                                   ("PosixPath", pathlib.PurePosixPath),
                                   ("PurePosixPath", pathlib.PurePosixPath),
                                   ("WindowsPath", pathlib.PureWindowsPath),
                                   ("PureWindowsPath", pathlib.PureWindowsPath))]
    return _table(
        Name("torch.Size", reduce=_torch_size, bounded=True),
        Name("torch.serialization._get_layout", reduce=_layout, bounded=True),
        Name("collections.OrderedDict", reduce=_ordered_dict, bounded=True),
        Name("builtins.set", reduce=lambda args: _collection(args, set)),
        Name("builtins.frozenset", reduce=lambda args: _collection(args, frozenset)),
        *paths,
    )


def _collection(args: tuple[Any, ...], kind: type) -> Any:
    # Protocol 2 writes a set as set([items]); the keys are counted like SETITEMS'.
    if not args:
        return kind()
    (items,) = _args(args, 1, kind.__name__)
    if type(items) is not list:
        raise Refusal(f"{kind.__name__} of {_describe(items)}")
    check_spread(items)
    return kind(items)


def _item_globals() -> dict[str, Name]:
    tensor_ref = _fields(TensorRef, {"path": as_str})
    # The typed storage classes of torch.save's archives (torch.FloatStorage, ...).
    storages = [Name(f"torch.{name}", dtype=dtype)
                for dtype, name in torch.storage._dtype_to_storage_type_map().items()]
    return _table(
        *storages,
        # torch.save's storage for dtypes without a typed storage class (uint16, float8).
        Name("torch.storage.UntypedStorage", dtype=torch.uint8),
        Name("_codecs.encode", reduce=_encode),
        Name("builtins.bytearray", reduce=_bytearray),
        Name("builtins.complex", reduce=_complex, bounded=True),
        Name("torch.device", reduce=_device, bounded=True),
        Name("torch._utils._rebuild_tensor_v2", reduce=_rebuild_tensor, bounded=True),
        Name("torch._utils._rebuild_tensor_v3", reduce=_rebuild_tensor_v3, bounded=True),
        Name("torch._utils._rebuild_parameter", reduce=_rebuild_parameter, bounded=True),
        Name("torch._tensor._rebuild_from_type_v2", reduce=_rebuild_from_type),
        # Only named inside _rebuild_from_type_v2's arguments, never called.
        Name("torch._utils._rebuild_wrapper_subclass"),
        *(Name(name) for name in _TENSOR_TYPES | _WRAPPED_WEIGHTS),
        *(Name(f"torchao.float8.float8_training_tensor.{name}", newobj=_plain_tuple)
          for name in ("LinearMMConfig", "ScaledMMConfig")),
        Name("dream_trainer.checkpoint.tensor_ref.TensorRef", build=tensor_ref),
        # Its name in checkpoints written while it was defined in checkpoint.state.
        Name("dream_trainer.checkpoint.state.TensorRef", build=tensor_ref),
    )


def check_spread(keys: list[Any], counts: Counter[int] | None = None) -> None:
    """Count ``keys`` by hash into ``counts``, one container's tally so far.

    Raises:
        Refusal: once more than ``MAX_SHARED_HASH`` share a hash.
    """
    try:
        count_keys(keys, Counter() if counts is None else counts, "a dict or set")
    except HashFloodError:
        raise Refusal(f"more than {MAX_SHARED_HASH} keys of one dict or set that share a "
                      "hash (crafted to make reading it take hours)") from None


def metadata_names() -> dict[str, Name]:
    """The globals a DCP ``.metadata`` may name."""
    return {**_common_globals(), **_dcp_globals()}


def item_names() -> dict[str, Name]:
    """The globals a ``torch.save`` archive of a checkpoint may name."""
    return {**_common_globals(), **_item_globals()}


def dtypes() -> dict[str, torch.dtype]:
    """``torch.<dtype>`` by full name: plain values a pickle may name."""
    return {f"torch.{name}": value for name, value in vars(torch).items()
            if isinstance(value, torch.dtype)}
