"""Loading pretrained weights into materialized models of any parallel layout.

The source is a directory in the Hugging Face layout (see ``weights/hf.py``) or a complete
dream_trainer checkpoint. Every model's state dict comes from ``model_state_dict``, so
its tensors are the live parameters, sharded as the model is (FSDP2, TP, both); torch DCP
then reads into them only the slices each rank owns (``SliceReader`` for safetensors),
converting the dtype as it copies. A parameter that the files hold as several tensors (the
experts of a transformers MoE, ``weights.stacked``) is read from each of them into its rows;
a rank reads only the tensors of the rows it holds; so is a tensor that the key map
transposes (``TransformedKey``). A key map's other transforms read their file tensor whole on
every rank, then keep the rank's shard of the result. No rank ever holds a full copy of the
model. A source may be a local directory or an object-store URL (``s3://bucket/prefix``):
files are read through the storage seam (``checkpoint.storage``), by byte ranges from an
object store.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch import nn

from dream_trainer.checkpoint.agreement import find_problem, load_failure
from dream_trainer.checkpoint.directory import MODEL_PREFIX, CheckpointError, is_complete
from dream_trainer.checkpoint.export import model_tensors
from dream_trainer.checkpoint.storage import location, storage_for
from dream_trainer.checkpoint.storage_base import Location
from dream_trainer.checkpoint.trust import safe_reader
from dream_trainer.nn.hf_moe import FILE_LAYOUTS, StackedKey
from dream_trainer.parallel.dtensor import local_tensor
from dream_trainer.parallel.state_dict import (load_model_state_dict, model_state_dict,
                                               renames_keys, state_keys)
from dream_trainer.weights.hf import KeyMap, check_hf_dir, is_hf_dir, tied_groups
from dream_trainer.weights.keys import TransformedKey, mapped_name
from dream_trainer.weights.peft_sources import (check_adapter_config, is_adapter_dir,
                                                is_adapter_key, peft_key_map)
from dream_trainer.weights.stacked import (Box, local_box, model_rules, stacked_boxes,
                                           transposed_box)
from dream_trainer.world.agree import agree_any, gather_objects, is_launched, is_rank_zero

logger = logging.getLogger(__name__)

T = TypeVar("T")
Sources = str | Path | Sequence[str | Path] | Mapping[str, str | Path | Sequence[str | Path]]
"""What ``init_weights_from`` may be: a directory, a list of directories for one model, or
``{model name: either}``."""

_SHOWN = 20  # keys listed per kind in an error; the rest are counted


@dataclass
class _Source:
    """One model's pretrained tensors: file key -> (DCP storage key, shape)."""

    path: Location
    reader: Any
    tensors: dict[str, tuple[str, tuple[int, ...]]]
    adapter: bool = False  # a peft adapter folder


@dataclass
class _Fit:
    """How a source's keys meet a model's: what loads where, and what does not fit."""

    targets: dict[str, torch.Tensor] = field(default_factory=dict)
    # Storage key -> box: a file tensor read into a slice of a stacked parameter.
    boxes: dict[str, Box] = field(default_factory=dict)
    stacked: list[torch.Tensor] = field(default_factory=list)  # the parameters boxes fill
    # (copy, loaded): a tied parameter's other copy on this rank, set from the loaded one.
    copies: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)
    # (file tensor read whole, its transform, the parameter): set after the read.
    transformed: list[tuple[torch.Tensor, TransformedKey, torch.Tensor]] = \
        field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    mismatched: list[str] = field(default_factory=list)
    # The whole state dict of a model whose hooks rename keys: its tensors may be copies
    # (a fused weight's parts), which reach the parameters through its load hooks.
    hooked: dict[str, torch.Tensor] | None = None
    claimed: set[str] = field(default_factory=set)  # the model keys the source sets


def resolve_sources(init_weights_from: Sources,
                    models: Mapping[str, nn.Module]) -> dict[str, list[Location]]:
    """Model name -> the directories (or URLs) to load it from, in order.

    A single Hugging Face directory goes to the one model that has a state; a single
    dream_trainer checkpoint to every such model (each reads its namesake in it). A list
    (a peft model's base directory, then an adapter folder) goes to one model as a single
    directory does; each of its directories sets the keys it holds.

    Raises:
        ValueError: for a mapping naming an unknown model, or one Hugging Face directory
            (or a list) for several models.
    """
    if isinstance(init_weights_from, Mapping):
        unknown = sorted(set(init_weights_from) - set(models))
        if unknown:
            raise ValueError(f"init_weights_from names {', '.join(map(repr, unknown))}, which "
                             f"configure_models did not create; the models are "
                             f"{', '.join(map(repr, models))}")
        return {name: _locations(paths) for name, paths in init_weights_from.items()}
    paths = _locations(init_weights_from)
    stateful = [name for name, model in models.items() if model.state_dict()]
    if len(stateful) > 1 and (len(paths) > 1 or _read(
            paths[0], lambda: is_hf_dir(paths[0], storage_for(paths[0])))):
        shown = [str(path) for path in paths]
        raise ValueError(f"init_weights_from={shown[0] if len(shown) == 1 else shown!r} names "
                         f"the weights of one model but the trainer has several models "
                         f"({', '.join(stateful)}): map each model to its own directory, e.g. "
                         "{'model': '/path/to/weights'}")
    return {name: paths for name in stateful}


def _locations(paths: str | Path | Sequence[str | Path]) -> list[Location]:
    return [location(path) for path in ([paths] if isinstance(paths, (str, Path)) else paths)]


class PretrainedWeights:
    """A load planned before the models are materialized and run after.

    Opening the sources reads only their metadata, so the names of the parameters that the
    files will set are known while the models are still on the meta device: materialization
    skips initializing them (``names``), and ``load`` then fills them. A model whose
    state-dict hooks rename keys (a fused q/k/v weight saved as three) is loaded through its
    own load hooks; the parameters behind its renamed keys are initialized first, then
    overwritten.

    Args:
        models: The trainer's models by name.
        init_weights_from: One directory, a list read in order into one model (a peft
            model's base, then an adapter folder), or ``{model name: either}`` (local paths
            or URLs such as ``s3://bucket/prefix``). A peft model reads a base's files under
            its own keys (``weights.peft_sources``).
        map_key: ``(model name, file key) -> model key``, a ``TransformedKey``, or None to
            skip the key.
        strict: Refuse missing and unexpected keys instead of warning about them.

    Raises:
        CheckpointError: for a source that is neither layout, or that cannot be read (naming
            it and the fix).
        ValueError: for a mapping naming an unknown model, or one Hugging Face directory
            for several models.
    """

    def __init__(self, models: Mapping[str, nn.Module],
                 init_weights_from: Sources, map_key: KeyMap, strict: bool) -> None:
        self.models = models
        self.map_key = map_key
        self.strict = strict
        self.sources = {name: [_read(path, lambda path=path, name=name: _open(path, name))
                               for path in paths]
                        for name, paths in resolve_sources(init_weights_from, models).items()}
        for name, source in ((name, source) for name, sources in self.sources.items()
                             for source in sources if source.adapter):
            check_adapter_config(source.path, storage_for(source.path), models[name])
        self.loaded: dict[str, set[str]] = {}  # after load: each model's keys the files set

    def paths(self, model_name: str) -> list[Location]:
        """Where ``model_name``'s weights come from, in the order they are read."""
        return [source.path for source in self.sources.get(model_name, [])]

    def use_models(self, models: Mapping[str, nn.Module]) -> None:
        """Load into ``models`` instead: a pipeline plans the load on the whole model and
        runs it on the container of its stages."""
        self.models = models

    def names(self, model_name: str) -> set[str]:
        """The model keys that the files of ``model_name`` will set (if they fit)."""
        model = self.models[model_name]
        owners = _owners(model_rules(model))
        keys = set()
        for source in self.sources.get(model_name, []):
            map_key = peft_key_map(state_keys(model), self.map_key, source.adapter)
            keys |= {owners.get(key, (key, 0))[0] for file_key in source.tensors
                     if (key := mapped_name(map_key(model_name, file_key))) is not None}
        if renames_keys(model):
            # A parameter whose name a hook replaced cannot be set by a file key of that name.
            keys &= state_keys(model)
        return keys

    def load(self, expected: Iterable[torch.Tensor] = (),
             device: torch.device = torch.device("cpu")) -> None:
        """Read the weights into the materialized models (collective).

        Args:
            expected: Parameters left uninitialized for this load (found by ``names``); each
                must be among the tensors it sets.
            device: The ranks' device, for their agreement on the outcome.

        Raises:
            CheckpointError: for shapes that differ (always) or, when strict, keys missing on
                either side, all listed in one message; or if an expected parameter was not
                set (it would train on NaN).
        """
        filled: set[int] = set()
        for name, sources in self.sources.items():
            fits = [_agree(_match(name, self.models[name], source,
                                  peft_key_map(state_keys(self.models[name]),
                                               self.map_key, source.adapter)))
                    for source in sources]
            _missing_from_all(fits)
            for source, fit in zip(sources, fits):
                filled |= self._load_source(name, source, fit)
            self.loaded[name] = set().union(*(fit.claimed for fit in fits))
        unfilled = [tuple(tensor.shape) for tensor in map(local_tensor, expected)
                    if tensor.numel() and tensor.data_ptr() not in filled]
        if agree_any(bool(unfilled), device):
            raise CheckpointError(
                "init_weights_from did not set parameters that were left for it (shapes "
                f"{unfilled[:5] or 'on another rank'}): their state-dict names differ from "
                "their parameter names; set init_weights_strict=True to see the keys")

    def _load_source(self, name: str, source: _Source, fit: _Fit) -> set[int]:
        """Read one source into model ``name`` as ``fit`` plans; return the addresses of the
        local tensors it set."""
        from torch.distributed.checkpoint import load
        from torch.distributed.checkpoint.api import CheckpointException

        from dream_trainer.weights.hf_reader import BoxPlanner

        path = source.path
        if fit.mismatched:
            raise CheckpointError(f"init_weights_from={str(path)!r} does not fit model "
                                  f"{name!r}: shapes differ for {_listing(fit.mismatched)}")
        if fit.missing or fit.unexpected:
            report = _report(name, path, fit)
            if self.strict:
                raise CheckpointError(
                    f"{report}. Rename keys in map_pretrained_key (return None to skip "
                    "one), or set init_weights_strict=False to load the rest and keep "
                    "init_weights() values for the missing keys")
            if is_rank_zero():
                logger.warning("%s; init_weights_strict=False: the missing keys keep "
                               "their init_weights() values", report)
        try:
            with warnings.catch_warnings():
                # One process is a valid case here; DCP warns that it assumes so.
                warnings.filterwarnings("ignore", message="torch.distributed is disabled")
                load(fit.targets, storage_reader=source.reader, planner=BoxPlanner(fit.boxes))
        except (Exception, CheckpointException) as exc:  # DCP's is a BaseException
            raise load_failure(exc, f"failed to load {path} into model {name!r}") from exc
        with torch.no_grad():
            for whole, transform, target in fit.transformed:
                _fill(target, transform.model_tensor(whole))
            for copy, loaded in fit.copies:
                local_tensor(copy).copy_(local_tensor(loaded))
        if fit.hooked is not None and fit.targets:
            _load_through_hooks(name, self.models[name], fit.hooked)
        logger.info("loaded %d tensors of model %s from %s",
                    len(fit.targets) + len(fit.boxes), name, path)
        fit.transformed.clear()  # the whole file tensors go now, not with the plan
        return {local_tensor(tensor).data_ptr()
                for tensor in [*fit.targets.values(), *fit.stacked]}


def _missing_from_all(fits: list[_Fit]) -> None:
    """Keep as missing only what no source of the model sets, and never a LoRA adapter that
    a base's files lack (peft initializes it)."""
    claimed = set().union(*(fit.claimed for fit in fits))
    for fit in fits:
        fit.missing = [entry for entry in fit.missing
                       if (key := entry.split(" ", 1)[0]) not in claimed
                       and not is_adapter_key(key)]
    for fit in fits[1:]:  # listed once
        fit.missing = [entry for entry in fit.missing if entry not in fits[0].missing]


def _load_through_hooks(name: str, model: nn.Module, state: dict[str, Any]) -> None:
    """Give ``model`` its state dict back through ``load_state_dict``, whose hooks carry the
    loaded values (under renamed keys) into the parameters."""
    try:
        with torch.no_grad():
            load_model_state_dict(model, state)
    except RuntimeError as exc:
        raise CheckpointError(
            f"init_weights_from loaded model {name!r} under the keys its state-dict hooks "
            f"write, but its load_state_dict does not take them back ({exc}); give it a load "
            "pre-hook that maps them to its parameters (as for a resume)") from exc


def _read(path: Location, read: Callable[[], T]) -> T:
    """``read()``, its storage's failures (no bucket, no access, no network) raised as an
    error naming ``path`` and the fix."""
    storage = storage_for(path)
    try:
        return read()
    except storage.failures as exc:
        raise CheckpointError(f"cannot read init_weights_from={str(path)!r}: "
                              f"{storage.explain(path, exc)}") from exc


def _open(path: Location, model_name: str) -> _Source:
    """Read the metadata (headers only) of the weights for ``model_name`` under ``path``."""

    from dream_trainer.weights.hf_reader import SliceReader

    storage = storage_for(path)
    adapter = is_adapter_dir(path, storage)
    if adapter or is_hf_dir(path, storage):
        if not adapter:
            check_hf_dir(path, storage)
        reader = SliceReader(path, storage)
        metadata = reader.read_metadata()
        tensors = {key: (key, tuple(entry.size))
                   for key, entry in metadata.state_dict_metadata.items()}
        return _Source(path, reader, tensors, adapter=adapter)
    if not is_complete(path):
        raise CheckpointError(
            f"init_weights_from={str(path)!r} is neither a Hugging Face weights directory "
            "(model.safetensors, or shards with model.safetensors.index.json), a peft "
            "adapter folder (adapter_model.safetensors and adapter_config.json) nor a "
            "complete dream_trainer checkpoint (a step_<N> directory with .metadata)"
            + ("" if _exists(path) else ": it does not exist"))
    reader = safe_reader(path)
    metadata = reader.read_metadata()
    # Each rank checksums a share of the files (in the layout that wrote them, its own data
    # files), not all of them; all raise if any found a problem.
    rank, world_size = (dist.get_rank(), dist.get_world_size()) if is_launched() else (0, 1)
    problem = find_problem(path, rank, world_size, group=None)
    if problem is not None:
        raise CheckpointError(problem)
    by_model = {model: {key: (f"{MODEL_PREFIX}{model}.{key}", tuple(entry.size))
                        for key, entry in entries.items()}
                for model, entries in model_tensors(metadata).items()}
    if model_name in by_model:
        return _Source(path, reader, by_model[model_name])
    if len(by_model) == 1:
        return _Source(path, reader, next(iter(by_model.values())))
    raise CheckpointError(f"checkpoint {path} holds the models {', '.join(sorted(by_model))} "
                          f"but none named {model_name!r}")


def _exists(path: Location) -> bool:
    storage = storage_for(path)
    # Listing, unlike a lookup, fails for a missing bucket: that is named, not "missing".
    return storage.is_dir(path) or storage.is_file(path) or bool(storage.list_dir(path))


def _match(name: str, model: nn.Module, source: _Source, map_key: KeyMap) -> _Fit:
    """Pair the source's keys with the model's (after ``map_key``); one rank's view."""
    whole = model_state_dict(model)
    state = {key: value for key, value in whole.items() if isinstance(value, torch.Tensor)}
    fit = _Fit(hooked=whole if renames_keys(model) else None)
    claimed: dict[str, str] = {}
    rules = model_rules(model)
    owners = _owners(rules)
    found: dict[str, dict[int, str]] = {}  # stacked key -> {part: storage key}
    for file_key, (storage_key, shape) in source.tensors.items():
        mapped = map_key(name, file_key)
        key = mapped_name(mapped)
        if key is None:
            continue
        owner, index = owners.get(key, (None, 0))
        if owner is not None and rules[owner].stacked and owner in state:
            expected = rules[owner].part_shape(tuple(state[owner].shape))
            if expected != shape:
                fit.mismatched.append(f"{file_key} (file {shape}, slice "
                                      f"{index // rules[owner].concat} of {owner} "
                                      f"{tuple(state[owner].shape)}: {expected})")
            else:
                found.setdefault(owner, {})[index] = storage_key
            continue
        key = owner or key  # a tensor the files hold under another name
        shown = file_key if key == file_key else f"{file_key} (as {key})"
        transform = mapped if isinstance(mapped, TransformedKey) else None
        if key not in state:
            fit.unexpected.append(f"{shown} {shape}")
        elif key in claimed:
            raise CheckpointError(f"map_pretrained_key({name!r}, ...) maps both "
                                  f"{claimed[key]!r} and {file_key!r} to {key!r}")
        elif transform is not None:
            _plan_transformed(fit, state[key], transform, storage_key, shape, shown)
            claimed[key] = file_key
        elif tuple(state[key].shape) != shape:
            fit.mismatched.append(f"{shown} (file {shape}, model {tuple(state[key].shape)})")
        else:
            claimed[key] = file_key
            fit.targets[storage_key] = state[key]
    # A tied parameter is loaded once the files hold it under any of its names. A
    # pipeline's stage may hold it under a name the files lack (the output layer of a model
    # whose files keep only the embedding): that copy reads the tensor stored for another.
    groups = tied_groups(model)
    stored = {}
    for file_key, (storage_key, shape) in source.tensors.items():
        key = map_key(name, file_key)  # a transformed key is never another's tied copy
        if isinstance(key, str) and key in groups:
            stored.setdefault(groups[key], (storage_key, shape))
    for key, tensor in state.items():
        if key in claimed or groups.get(key, -1) not in stored:
            continue
        storage_key, shape = stored[groups[key]]
        if tuple(tensor.shape) != shape:
            fit.mismatched.append(f"{key} (file {shape}, model {tuple(tensor.shape)})")
        elif storage_key not in fit.targets:
            fit.targets[storage_key] = tensor
        elif fit.targets[storage_key] is not tensor:
            fit.copies.append((tensor, fit.targets[storage_key]))
        claimed[key] = storage_key
    for key, slices in found.items():
        if len(slices) < len(rules[key].parts) or key in claimed:
            continue  # a missing key, listed below, unless the files hold it whole too
        claimed[key] = key
        fit.boxes.update(stacked_boxes(state[key], rules[key], slices))
        fit.stacked.append(state[key])
    fit.missing = [f"{key} {tuple(tensor.shape)}{_absent(rules.get(key), found.get(key))}"
                   for key, tensor in state.items() if key not in claimed]
    fit.claimed = set(claimed)
    return fit


def _plan_transformed(fit: _Fit, target: torch.Tensor, transform: TransformedKey,
                      storage_key: str, shape: tuple[int, ...], shown: str) -> None:
    """Plan the read of a file tensor that a key map transforms into ``target``: a
    transpose reads this rank's part into a transposed view of its shard; another function
    reads the whole tensor (into a buffer of the target's dtype, on the CPU), then keeps
    this rank's part of the result (``_fill``)."""
    try:
        expected = transform.model_shape(shape)
    except (RuntimeError, ValueError) as exc:
        fit.mismatched.append(f"{shown} (file {shape}: the key map's transform fails on it: "
                              f"{exc})")
        return
    if expected != tuple(target.shape):
        fit.mismatched.append(f"{shown} (file {shape}, transformed {expected}, model "
                              f"{tuple(target.shape)})")
    elif transform.transpose is not None:
        box = transposed_box(target, transform.dims(target.dim()))
        if box[1].numel():  # a rank may hold none of it (more FSDP2 ranks than rows)
            fit.boxes[storage_key] = box
        fit.stacked.append(target)
    else:
        whole = torch.empty(shape, dtype=target.dtype)
        fit.targets[storage_key] = whole
        fit.transformed.append((whole, transform, target))
        fit.stacked.append(target)


def _fill(target: torch.Tensor, value: torch.Tensor) -> None:
    """Copy this rank's shard of ``value`` (the whole tensor) into ``target``'s shard."""
    offsets, local = local_box(target)
    for dim, (offset, length) in enumerate(zip(offsets, local.shape)):
        value = value.narrow(dim, offset, length)
    local.copy_(value)


def _owners(rules: Mapping[str, StackedKey]) -> dict[str, tuple[str, int]]:
    """File key (after ``map_key``) -> (the model key of the rule that reads it, its place
    among the rule's parts)."""
    return {part: (rule.key, index) for rule in rules.values()
            for index, part in enumerate(rule.parts)}


def _absent(rule: StackedKey | None, slices: dict[int, str] | None) -> str:
    """For a missing stacked key: which of its file tensors the files lack."""
    if rule is None or not rule.stacked:
        return ""
    lacking = [part for index, part in enumerate(rule.parts) if index not in (slices or {})]
    return f" (the files lack {len(lacking)} of its {len(rule.parts)} tensors: {lacking[0]}...)"


def _agree(fit: _Fit) -> _Fit:
    """Combine every rank's view, so that all ranks raise or load together: a key is missing
    or mismatched if it is on any rank, unexpected only if no rank has it (a pipeline stage
    holds only its own blocks)."""
    views = gather_objects((fit.missing, fit.unexpected, fit.mismatched))
    everywhere = set.intersection(*(set(unexpected) for _, unexpected, _ in views))
    fit.missing = list(dict.fromkeys(key for missing, _, _ in views for key in missing))
    fit.unexpected = [key for key in views[0][1] if key in everywhere]
    fit.mismatched = list(dict.fromkeys(key for _, _, mismatched in views for key in mismatched))
    return fit


def _report(name: str, path: Location, fit: _Fit) -> str:
    parts = []
    if fit.missing:
        parts.append(f"{len(fit.missing)} missing (in the model, not in the files): "
                     f"{_listing(fit.missing)}")
    if fit.unexpected:
        parts.append(f"{len(fit.unexpected)} unexpected (in the files, not in the model): "
                     f"{_listing(fit.unexpected)}")
    if any(".experts.gate_up_proj " in key for key in fit.missing):
        parts.append("transformers' stacked experts (experts.gate_up_proj) read the files' "
                     "one tensor per expert only for the model types declared in "
                     f"dream_trainer.nn.hf_moe.FILE_LAYOUTS ({', '.join(FILE_LAYOUTS)}): "
                     "declare your model type's layout there")
    return f"init_weights_from={str(path)!r} does not fit model {name!r}: " + "; ".join(parts)


def _listing(keys: list[str]) -> str:
    shown = ", ".join(keys[:_SHOWN])
    return shown + (f" and {len(keys) - _SHOWN} more" if len(keys) > _SHOWN else "")
