"""A pickle decoder for checkpoints from anywhere: it builds data, never runs or changes code.

An allowlist of globals is not enough with a stock unpickler. ``BUILD`` sets state on
whatever object is on the stack, a class included: a crafted ``.metadata`` that names an
allowed class (``pathlib.PurePosixPath``) and then ``BUILD``s it sets class attributes, and
every path the process handles afterwards points where the file chose. So this decoder runs
its own versions of the opcodes that reach objects:

- ``GLOBAL`` pushes a *name* (``allowlist.Name``), never the class or function it names (dtypes,
  plain values, are the exception). A name outside the allowlist is refused at once.
- ``REDUCE`` on a name calls that name's builder, which checks the arguments and makes a
  fresh value (``torch.Size`` of non-negative ints, a path of strings, a tensor whose view
  lies inside its storage).
- ``NEWOBJ`` on a name makes a placeholder; the ``BUILD`` that follows hands the state to the
  name's builder, which checks every field and calls the class's own constructor. ``BUILD``
  on anything else (a class, a builtin, a finished object) is refused.
- Dicts and sets are filled through ``hash_guard``'s count of keys per hash, so a file of
  colliding keys is refused in linear time instead of inserted in quadratic time; nesting
  is bounded; ``INST``, ``OBJ``, extension codes and out-of-band buffers are refused.
- Every value hashed, handed to a builder or returned is charged to a ``budget.Budget`` of
  the pickle's bytes, each shared reference counted again: memo references crafted to
  expand a kilobyte into 2**64 values are refused after at most the budget's work.

A user's own class is allowed only by name (``trusted_globals``), and then unpickles the
standard way: the user vouched for its code.
"""

from __future__ import annotations

import _compat_pickle
import dataclasses
import functools
import io
import pathlib
import pickle
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch

from dream_trainer.checkpoint.allowlist import (Name, Refusal, Storage, as_int, as_str,
                                                check_spread, dtypes, item_names,
                                                metadata_names)
from dream_trainer.checkpoint.budget import MAX_DEPTH, Budget
from dream_trainer.errors import CheckpointError

MAX_PICKLE_BYTES = 1 << 30
"""Largest pickle read (1 GiB): the metadata of a checkpoint with millions of chunks is tens
of MB."""


class _Pending:
    """An instance ``NEWOBJ`` announced, waiting for its ``BUILD``; where the memo holds it."""

    __slots__ = ("spec", "memo_keys")

    def __init__(self, spec: Name) -> None:
        self.spec = spec
        self.memo_keys: list[Any] = []


# -- the decoder ----------------------------------------------------------------------------
_REFUSED_OPCODES = {
    pickle.INST: "INST (calls a class)", pickle.OBJ: "OBJ (calls a class)",
    pickle.EXT1: "an extension code", pickle.EXT2: "an extension code",
    pickle.EXT4: "an extension code", pickle.NEWOBJ_EX: "NEWOBJ_EX",
    pickle.NEXT_BUFFER: "an out-of-band buffer", pickle.READONLY_BUFFER: "a read-only buffer",
    pickle.PERSID: "a text persistent id",
}


def _refusing(what: str) -> Callable[[Any], None]:
    def refuse(unpickler: Any) -> None:
        raise Refusal(f"{what}, which is never allowed")
    return refuse


class _SafeUnpickler(pickle._Unpickler):  # type: ignore[name-defined]
    """The pure-Python unpickler with the object-reaching opcodes replaced (see the module
    docstring). ``storages`` resolves a ``torch.save`` archive's persistent ids."""

    dispatch = dict(pickle._Unpickler.dispatch)  # type: ignore[attr-defined]

    def __init__(self, data: bytes, names: Mapping[str, Name],
                 values: Mapping[str, Any],
                 storages: Callable[[str, torch.dtype, int], Storage] | None = None) -> None:
        super().__init__(io.BytesIO(data))
        self.names = names
        self.values = values
        self.storages = storages
        self.counts: dict[int, tuple[Any, Counter[int]]] = {}
        self.depths: dict[int, tuple[Any, int]] = {}
        self.buildable: dict[int, Any] = {}
        self.vouched: dict[int, Any] = {}  # what the user's trusted code made, by id
        self.budget = Budget(len(data))

    # GLOBAL / STACK_GLOBAL
    def find_class(self, module: str, name: str) -> Any:
        if self.proto < 3:  # Python 2 names, as the stock unpickler maps them
            if (module, name) in _compat_pickle.NAME_MAPPING:
                module, name = _compat_pickle.NAME_MAPPING[(module, name)]
            module = _compat_pickle.IMPORT_MAPPING.get(module, module)
        full = f"{module}.{name}"
        if full in self.values:
            return self.values[full]
        if full in self.names:
            return self.names[full]
        raise _NotAllowed(full)

    def _reduce(self) -> None:
        args = self.stack.pop()
        spec = self.stack[-1]
        if not isinstance(args, tuple):
            raise Refusal("REDUCE without an argument tuple")
        if not (isinstance(spec, Name) and spec.bounded):
            self.budget.charge(args)  # what the builder (or the user's code) goes through
        if isinstance(spec, Name) and spec.trusted is not None:
            made = spec.trusted(*args)
            self.vouched[id(made)] = made
            self.stack[-1] = made
        elif isinstance(spec, Name) and spec.reduce is not None:
            self.stack[-1] = spec.reduce(args)
        else:
            raise Refusal(f"a call of {_name(spec)}")

    def _newobj(self) -> None:
        args = self.stack.pop()
        spec = self.stack.pop()
        if type(args) is tuple and args:
            self.budget.charge(args)
        if isinstance(spec, Name) and spec.trusted is not None:
            obj = spec.trusted.__new__(spec.trusted, *args)
            self.buildable[id(obj)] = self.vouched[id(obj)] = obj
        elif isinstance(spec, Name) and args == () and spec.build is not None:
            obj = _Pending(spec)
        elif isinstance(spec, Name) and args == () and spec.empty is not None:
            obj = spec.empty()
        elif isinstance(spec, Name) and spec.newobj is not None and type(args) is tuple:
            obj = spec.newobj(args)
        else:
            raise Refusal(f"creating {_name(spec)}")
        self.append(obj)

    def _build(self) -> None:
        state = self.stack.pop()
        target = self.stack[-1]
        charged = self.budget.charge((state,))  # what the builder checks and copies
        if isinstance(target, _Pending):
            built = target.spec.build(state)  # type: ignore[misc]
            self.budget.record(built, charged)
            self.stack[-1] = built
            for key in target.memo_keys:
                if self.memo.get(key) is target:
                    self.memo[key] = built
        elif self.buildable.pop(id(target), None) is target:
            _standard_build(target, state)
        else:
            raise Refusal(f"setting the state of {_name(target)} (only a fresh instance of an "
                          "allowed class takes state)")

    # The memo: where a placeholder is stored, so that its BUILD can replace it there too.
    def _remember(self, key: int) -> None:
        value = self.stack[-1]
        self.memo[key] = value
        if type(value) is _Pending:
            value.memo_keys.append(key)

    def _put(self) -> None:
        self._remember(as_int(int(self.readline()[:-1]), "a memo key"))

    def _binput(self) -> None:
        self._remember(self.read(1)[0])

    def _long_binput(self) -> None:
        self._remember(int.from_bytes(self.read(4), "little"))

    def _memoize(self) -> None:
        self._remember(len(self.memo))

    # Containers: keys counted per hash; hashable containers' depth bounded.
    def _counted(self, container: Any, keys: list[Any]) -> None:
        # Hashing a tuple visits all of it, every time (strings cache their hash).
        nested = [key for key in keys if isinstance(key, (tuple, frozenset))]
        if nested:
            self.budget.charge(nested)
        entry = self.counts.setdefault(id(container), (container, Counter()))
        check_spread(keys, entry[1])

    def _append(self) -> None:
        value = self.stack.pop()
        self._list().append(value)

    def _appends(self) -> None:
        items = self.pop_mark()
        self._list().extend(items)

    def _list(self) -> list[Any]:
        target = self.stack[-1]
        if type(target) is not list:
            raise Refusal(f"appending to {_name(target)}")
        return target

    def _setitem(self) -> None:
        value = self.stack.pop()
        key = self.stack.pop()
        target = self._mapping()
        self._counted(target, [key])
        target[key] = value

    def _setitems(self) -> None:
        items = self.pop_mark()
        target = self._mapping()
        keys = items[::2]
        self._counted(target, keys)
        for key, value in zip(keys, items[1::2]):
            target[key] = value

    def _dict(self) -> None:
        items = self.pop_mark()
        target: dict[Any, Any] = {}
        keys = items[::2]
        self._counted(target, keys)
        target.update(zip(keys, items[1::2]))
        self.append(target)

    def _additems(self) -> None:
        items = self.pop_mark()
        target = self.stack[-1]
        if type(target) is not set:
            raise Refusal(f"adding items to {_name(target)}")
        self._counted(target, items)
        target.update(items)

    def _frozenset(self) -> None:
        items = self.pop_mark()
        self.budget.charge(items)
        check_spread(items)
        self.append(self._deep(frozenset(items), items))

    def _mapping(self) -> Any:
        target = self.stack[-1]
        if type(target) not in (dict, OrderedDict):
            raise Refusal(f"setting items of {_name(target)}")
        return target

    def _deep(self, container: Any, items: Any) -> Any:
        """Record the nesting depth of a hashable container; refuse one too deep to hash
        (hashing recurses in C, without the interpreter's recursion limit)."""
        deepest = 0
        for item in items:
            kind = type(item)
            if kind is tuple or kind is frozenset:
                entry = self.depths.get(id(item))
                depth = entry[1] if entry is not None and entry[0] is item else 1
                deepest = max(deepest, depth)
        if deepest >= MAX_DEPTH:
            raise Refusal(f"containers nested more than {MAX_DEPTH} deep")
        if deepest:
            self.depths[id(container)] = (container, deepest + 1)
        return container

    def _tuple(self) -> None:
        items = self.pop_mark()
        self.append(self._deep(tuple(items), items))

    def _tuple1(self) -> None:
        items = (self.stack[-1],)
        self.stack[-1] = self._deep(items, items)

    def _tuple2(self) -> None:
        items = (self.stack[-2], self.stack[-1])
        self.stack[-2:] = [self._deep(items, items)]

    def _tuple3(self) -> None:
        items = (self.stack[-3], self.stack[-2], self.stack[-1])
        self.stack[-3:] = [self._deep(items, items)]

    def _binpersid(self) -> None:
        pid = self.stack.pop()
        if self.storages is None:
            raise Refusal("a persistent id outside a torch.save archive")
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"
                and isinstance(pid[1], Name) and pid[1].dtype is not None):
            raise Refusal("a persistent id other than a typed storage")
        _, spec, key, _location, count = pid
        self.append(self.storages(as_str(key, "a storage key"), spec.dtype,
                                  as_int(count, "a storage size")))

    dispatch[pickle.REDUCE[0]] = _reduce
    dispatch[pickle.NEWOBJ[0]] = _newobj
    dispatch[pickle.BUILD[0]] = _build
    dispatch[pickle.PUT[0]] = _put
    dispatch[pickle.BINPUT[0]] = _binput
    dispatch[pickle.LONG_BINPUT[0]] = _long_binput
    dispatch[pickle.MEMOIZE[0]] = _memoize
    dispatch[pickle.APPEND[0]] = _append
    dispatch[pickle.APPENDS[0]] = _appends
    dispatch[pickle.SETITEM[0]] = _setitem
    dispatch[pickle.SETITEMS[0]] = _setitems
    dispatch[pickle.DICT[0]] = _dict
    dispatch[pickle.ADDITEMS[0]] = _additems
    dispatch[pickle.FROZENSET[0]] = _frozenset
    dispatch[pickle.TUPLE[0]] = _tuple
    dispatch[pickle.TUPLE1[0]] = _tuple1
    dispatch[pickle.TUPLE2[0]] = _tuple2
    dispatch[pickle.TUPLE3[0]] = _tuple3
    dispatch[pickle.BINPERSID[0]] = _binpersid
    for _opcode, _what in _REFUSED_OPCODES.items():
        dispatch[_opcode[0]] = _refusing(_what)
    del _opcode, _what


class _NotAllowed(Exception):
    """A global outside the allowlist (its full name)."""


def _name(value: Any) -> str:
    if isinstance(value, Name):
        return value.name
    if isinstance(value, _Pending):
        return f"an unfinished {value.spec.name}"
    return f"a {type(value).__qualname__}"


def _standard_build(target: Any, state: Any) -> None:
    """``BUILD`` as pickle does it, for a fresh instance of a class the user trusts."""
    setstate = getattr(target, "__setstate__", None)
    if setstate is not None:
        setstate(state)
        return
    slots = None
    if isinstance(state, tuple) and len(state) == 2:
        state, slots = state
    if state:
        target.__dict__.update(state)
    for key, value in (slots or {}).items():
        setattr(target, key, value)


# -- what the result may hold ---------------------------------------------------------------
_LEAVES = (type(None), bool, int, float, complex, str, bytes, bytearray, torch.dtype,
           torch.layout, torch.device, torch.memory_format, torch.Tensor, pathlib.PurePath)


def _children(value: Any, vouched: Mapping[int, Any]) -> Iterator[Any] | None:
    """The values inside ``value``, or None for a leaf.

    Raises:
        Refusal: for a placeholder or a name left in the result.
    """
    if isinstance(value, dict):
        return iter([*value.keys(), *value.values()])
    if isinstance(value, (list, tuple, set, frozenset)):
        return iter(value)
    if isinstance(value, _LEAVES) or vouched.get(id(value)) is value:
        return None
    if isinstance(value, (_Pending, Name)):
        raise Refusal(f"{_name(value)} left in the result (a name never called, or an "
                      "instance never given its state)")
    if dataclasses.is_dataclass(value):
        return iter(vars(value).values()) if hasattr(value, "__dict__") \
            else iter(getattr(value, f.name) for f in dataclasses.fields(value))
    if type(value).__module__ == "torch.distributed.checkpoint.metadata":
        return None  # the memory-format code
    raise Refusal(f"a {type(value).__qualname__} in the result")


# -- entry points ---------------------------------------------------------------------------
@functools.cache
def _allowed(kind: str) -> dict[str, Name]:
    return metadata_names() if kind == "metadata" else item_names()


def _is_metadata(value: Any) -> bool:
    from torch.distributed.checkpoint.metadata import Metadata

    return type(value) is Metadata


def _names(kind: str, trusted: Mapping[str, Any]) -> tuple[dict[str, Name], dict[str, Any]]:
    if not trusted:
        return _allowed(kind), _dtypes()
    user = {name: Name(name, trusted=obj) for name, obj in trusted.items()}
    return {**_allowed(kind), **user}, _dtypes()


_dtypes = functools.cache(dtypes)


def loads(data: bytes, source: str, kind: str = "metadata",
          trusted: Mapping[str, Any] | None = None,
          storages: Callable[[str, torch.dtype, int], Storage] | None = None) -> Any:
    """Decode one pickle of a checkpoint.

    Args:
        data: The pickle's bytes (at most ``MAX_PICKLE_BYTES``).
        source: Names the file (and item) in errors.
        kind: ``"metadata"`` (DCP's ``.metadata``) or ``"item"`` (a ``torch.save`` archive's
            ``data.pkl``: containers, scalars, tensors).
        trusted: The user's trusted classes and functions by full name.
        storages: Resolves an archive's storage ids (key, dtype, element count).

    Raises:
        CheckpointError: naming ``source`` and what was refused.
    """
    trusted = dict(trusted or {})
    if len(data) > MAX_PICKLE_BYTES:
        raise CheckpointError(f"{source} is {len(data)} bytes, more than the "
                              f"{MAX_PICKLE_BYTES} a checkpoint's pickle may have")
    names, values = _names(kind, trusted)
    # A refusal is raised after the handler, not from it: it says everything, and whoever
    # looks for the innermost cause of a failure (DCP's wrapper) should find it, not ours.
    refused: CheckpointError | None = None
    try:
        unpickler = _SafeUnpickler(data, names, values, storages)
        value = unpickler.load()
        if kind == "item":
            # Every reference counted again: what readers do with the result (move its
            # tensors, put packed tensors back) visits it that way.
            unpickler.budget.walk(value, functools.partial(_children,
                                                           vouched=unpickler.vouched))
        elif not _is_metadata(value):
            raise Refusal(f"{_name(value)} where DCP's Metadata belongs")
        # A Metadata holds only what the builders made, and its BUILD charged all of it,
        # each built part as often as it is referenced (what DCP's planner visits).
    except _NotAllowed as exc:
        refused = refusal(str(exc), source)
    except Refusal as exc:
        refused = CheckpointError(f"{source} cannot be read safely: it holds {exc}; it was not "
                                  "written by dream_trainer or torch, or was altered")
    except CheckpointError:
        raise
    except (RecursionError, MemoryError) as exc:
        refused = CheckpointError(f"{source} cannot be read: {type(exc).__name__}")
    except Exception as exc:
        raise CheckpointError(f"cannot read {source}: {type(exc).__name__}: {exc}") from exc
    if refused is not None:
        raise refused
    return value


def refusal(found: str, source: str) -> CheckpointError:
    """The error for a global outside the allowlist."""
    return CheckpointError(
        f"{source} would unpickle {found}, which is not an allowed type: reading it could run "
        "code. If this checkpoint comes from a run you trust and the type is yours, allow it "
        f"with checkpoint_parameters.trusted_globals=['{found}'] (or "
        "dream_trainer.checkpoint.trust_globals)")
