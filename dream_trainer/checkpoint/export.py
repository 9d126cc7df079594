"""Turning a (sharded) checkpoint, or the models of a running trainer, into safetensors
weights: one file per model, or the Hugging Face layout (written with
``dream_trainer.weights.hf``). Checkpoints and targets may be local directories or
object-store URLs (``s3://bucket/prefix``), through the storage seam (``checkpoint.storage``).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch import nn

from dream_trainer.checkpoint.agreement import load_failure
from dream_trainer.checkpoint.directory import (METADATA, MODEL_PREFIX, CheckpointError,
                                                is_complete, verify_files)
from dream_trainer.checkpoint.storage import location, storage_for
from dream_trainer.checkpoint.storage_base import Location, below
from dream_trainer.checkpoint.trust import safe_reader
from dream_trainer.nn.hf_moe import StackedKey
from dream_trainer.parallel.state_dict import model_state_dict
from dream_trainer.utils.paths import component_problem
from dream_trainer.weights.hf import (DEFAULT_MAX_SHARD_BYTES, ExportFormat, KeyMap, StateOf,
                                      check_out_dir, export_live, export_paths,
                                      exported_state, is_weight_file, plan_shards,
                                      replace_file, replace_weights, shard_file_names,
                                      write_index, write_model_config)
from dream_trainer.weights.stacked import Part, checkpoint_rules, exported_parts, model_rules
from dream_trainer.weights.staging import Staging
from dream_trainer.world.agree import barrier, from_rank_zero, is_rank_zero

_STAGING = ".export.partial"
"""Where a live export to an object store saves the ranks' slices before rank 0 joins them."""


def export_checkpoint(checkpoint: str | Path | Location, out_dir: str | Path | Location,
                      format: ExportFormat = "safetensors", dtype: torch.dtype | None = None,
                      map_key: KeyMap | None = None,
                      max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
                      overwrite: bool = False,
                      model_type: str | None = None) -> dict[str, Location]:
    """Write the weights of every model in ``checkpoint`` as safetensors, inside ``out_dir``.

    ``"safetensors"`` writes ``<out_dir>/<model>.safetensors`` with the model's own keys.
    ``"hf"`` writes the Hugging Face layout: ``model.safetensors``, or shards of at most
    ``max_shard_bytes`` with ``model.safetensors.index.json``, keyed by ``map_key``; in
    ``out_dir`` itself for a checkpoint of one model, else in ``<out_dir>/<model>/``. Runs in
    one process, without a process group, whatever number of ranks wrote the checkpoint; only
    model weights are read, one output file at a time (peak memory: the largest file, or the
    largest stacked tensor it takes experts from).

    Args:
        checkpoint: A complete ``step_<N>`` checkpoint directory, or its URL.
        out_dir: Where to write (a directory, created when missing, or a URL: the files are
            written in a temporary directory, then uploaded). It must be empty unless
            ``overwrite`` is set.
        format: ``"safetensors"`` or ``"hf"``.
        dtype: Cast floating tensors to it (``torch.bfloat16``); None keeps the saved dtype.
        map_key: ``(model name, key) -> exported key`` (None leaves the key out; a
            ``TransformedKey`` also transforms the tensor); ``"hf"`` only.
            ``trainer.map_exported_key`` is the usual one.
        max_shard_bytes: Largest shard of an ``"hf"`` export.
        overwrite: Export into a non-empty ``out_dir``: the weight files of an earlier export
            there are replaced once the new ones are written; other files stay.
        model_type: ``"hf"`` only: the transformers model type (``config.json``'s
            ``model_type``, e.g. ``"mixtral"``, ``"qwen3_moe"``) whose files the experts of
            ``MoE`` layers and of transformers' own blocks are written as, one tensor per
            expert as ``save_pretrained`` writes them (``nn.hf_moe.FILE_LAYOUTS``); None
            writes them stacked, as trained.

    Returns:
        The written file (``"safetensors"``) or directory (``"hf"``) of each model.

    Raises:
        CheckpointError: if the checkpoint is incomplete or damaged, holds no weights, or
            names a model that is not a plain file name; or if an object store cannot be
            read or written (naming the URL and the fix).
        FileExistsError: if ``out_dir`` is not empty and ``overwrite`` is False.
        ValueError: for an unknown format, two keys mapped to the same name, or MoE layers
            and a ``model_type`` without a declared file layout.
    """
    if format not in ("hf", "safetensors"):
        raise ValueError(f"format={format!r}: expected 'safetensors' (one file per model) or "
                         "'hf' (the Hugging Face layout)")
    checkpoint, out_dir = location(checkpoint), location(out_dir)
    with _naming(checkpoint, "read"):
        if not is_complete(checkpoint):
            raise CheckpointError(f"{checkpoint} is not a complete dream_trainer checkpoint")
    with _naming(out_dir, "write"):
        # Before the checksums, which may take minutes.
        check_out_dir(out_dir, overwrite, storage_for(out_dir))
    with _naming(checkpoint, "read"):
        reader = safe_reader(checkpoint)
        metadata = reader.read_metadata()
        verify_files(checkpoint, metadata)
        _refuse_left_out(checkpoint)
    models = model_tensors(metadata)
    if not models:
        raise CheckpointError(f"{checkpoint} holds no model weights")
    for model in models:
        # Each name becomes a file or directory name in out_dir.
        problem = component_problem(model)
        if problem is not None:
            raise CheckpointError(
                f"{checkpoint / METADATA} names the model {model!r}, which {problem}: an "
                "export writes each model to a file named after it, inside OUT_DIR. The "
                "checkpoint was altered or crafted; nothing was written")
    rules = {model: checkpoint_rules({key: entry.size for key, entry in tensors.items()},
                                     model_type if format == "hf" else None)
             for model, tensors in models.items()}
    return _write_models(reader, models, out_dir, format, dtype, map_key, max_shard_bytes,
                         several=len(models) > 1, rules=rules)


def _refuse_left_out(checkpoint: Location) -> None:
    """A checkpoint that left frozen weights out (``checkpoint.frozen``) holds no whole
    model to write."""
    from dream_trainer.checkpoint.models_record import read_record

    frozen, _ = read_record(checkpoint)
    for model, source in frozen.items():
        raise CheckpointError(
            f"{checkpoint} leaves out the {len(source.keys)} frozen weights of model "
            f"{model!r} (they are read from {source.describe()}): an export of it would lack "
            "them. Export its adapter with --format peft, merge it from a run with "
            "export_weights(path, format='hf', merge_adapters=True), or checkpoint with "
            "save_frozen_weights=True")


def export_models(models: Mapping[str, nn.Module], path: str | Path | Location,
                  format: ExportFormat, map_key: KeyMap | None, dtype: torch.dtype | None,
                  max_shard_bytes: int, overwrite: bool = False,
                  merge_adapters: bool = False) -> dict[str, Location]:
    """Write every model's weights from a running trainer (collective); see
    ``SetupMixin.export_weights`` for the layout. ``merge_adapters`` writes each peft
    model's base with its LoRA adapter merged (``weights.peft_merge.merged_state``).

    A local ``path`` is written as ``weights.hf.export_live`` does (the ranks share the
    filesystem). To an object store, the ranks save their slices under ``path`` as a DCP
    checkpoint does, then rank 0 joins them one output file at a time, as
    ``export_checkpoint`` does, uploads the files and deletes the slices.

    Returns:
        What was written for each model: its Hugging Face directory, or its file.

    Raises:
        FileExistsError: on every rank, if ``path`` is not empty and ``overwrite`` is False.
        CheckpointError: on every rank, naming the URL and the fix, if the store cannot be
            written.
        ValueError: for an unknown format, or two keys mapped to the same name; with
            ``merge_adapters``, for what ``weights.peft_merge.merged_models`` refuses.
    """
    import torch.distributed.checkpoint as dcp

    state_of: StateOf = model_state_dict
    if merge_adapters:
        from dream_trainer.weights.peft_merge import merged_models, merged_state

        models = merged_models(models, format)  # each peft model's base, its LoRA in place
        state_of = partial(merged_state, dtype=dtype)
    target = location(path)
    storage = storage_for(target)
    if isinstance(target, Path):
        return dict(export_live(models, target, format, map_key, dtype, max_shard_bytes,
                                storage, overwrite, state_of))
    if format not in ("hf", "safetensors"):
        raise ValueError(f"format={format!r}: expected 'hf' (Hugging Face layout) or "
                         "'safetensors' (one file per model, the trainer's keys)")
    staging = target / _STAGING

    def prepare() -> None:
        check_out_dir(target, overwrite, storage)
        if storage.list_dir(staging):
            storage.remove_tree(staging)  # what a failed export left

    _on_rank_zero(target, prepare)
    # The models' own keys, tied copies dropped: rank 0 renames and casts as it joins them.
    state = {f"{MODEL_PREFIX}{name}.{key}": tensor for name, model in models.items()
             for key, tensor in exported_state(name, model, None, None, None,
                                               state_of).items()}
    barrier()
    try:
        with warnings.catch_warnings():
            # One process is a valid case here; DCP warns that it assumes so.
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.save(state, storage_writer=storage.writer(staging))
    except Exception as exc:
        raise CheckpointError(f"cannot write the export to {target}: {exc}") from exc
    written: dict[str, Location] = {}

    def join() -> None:
        reader = safe_reader(staging)
        tensors = model_tensors(reader.read_metadata())
        configs = (lambda name, directory: write_model_config(models[name], directory)) \
            if format == "hf" else None
        rules = {name: model_rules(model) for name, model in models.items()}
        written.update(_write_models(reader, tensors, target, format, dtype, map_key,
                                     max_shard_bytes, several=len(models) > 1,
                                     configs=configs, rules=rules))
        storage.remove_tree(staging)

    _on_rank_zero(target, join)
    return from_rank_zero(written)


def model_tensors(metadata: Any) -> dict[str, dict[str, Any]]:
    """Model name -> {key: tensor metadata} for every model tensor of a dream_trainer
    checkpoint's DCP metadata (its full key is ``MODEL_PREFIX + model + "." + key``)."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    models: dict[str, dict[str, Any]] = {}
    for key, entry in metadata.state_dict_metadata.items():
        model, _, name = key.removeprefix(MODEL_PREFIX).partition(".")
        if key.startswith(MODEL_PREFIX) and name and isinstance(entry, TensorStorageMetadata):
            models.setdefault(model, {})[name] = entry
    return models


def _write_models(reader: Any, models: dict[str, dict[str, Any]], out_dir: Location,
                  format: ExportFormat, dtype: torch.dtype | None, map_key: KeyMap | None,
                  max_shard_bytes: int, several: bool,
                  configs: Callable[[str, Path], None] | None = None,
                  rules: Mapping[str, Mapping[str, StackedKey]] | None = None
                  ) -> dict[str, Location]:
    """Write each model's tensors (``model_tensors``) that ``reader`` reads into ``out_dir``,
    through a local directory that stands for it (``Storage.local_dir``); ``configs(model,
    directory)`` adds files beside a model's Hugging Face weights; ``rules[model]`` splits
    its stacked tensors in the Hugging Face layout."""
    written: dict[str, Location] = {}
    with storage_for(out_dir).local_dir(out_dir, is_weight_file) as local:
        for model, tensors in models.items():
            target = export_paths(local, model, format, several=several, make_room=True)
            # Written in a private directory, by descriptor (weights.staging): a failed
            # write leaves the old files whole, and a link planted in OUT_DIR meanwhile is
            # never followed.
            with Staging(local, model) as staging:
                if format == "safetensors":
                    write_file(reader, model, {name: Part(name) for name in tensors},
                                tensors, dtype, staging, target.name)
                    replace_file(staging, target.name, target)
                else:
                    _write_hf(reader, model, tensors, dtype, map_key, max_shard_bytes,
                              staging, (rules or {}).get(model, {}))
                    if configs is not None:
                        configs(model, staging.path)
                    replace_weights(staging, target)
            written[model] = below(out_dir, *target.relative_to(local).parts)
    return written


@contextmanager
def _naming(path: Location, doing: str) -> Iterator[None]:
    """Raise a failure of ``path``'s storage that it can explain (no bucket, no access, no
    network) as an error naming ``path`` and the fix; others as they are."""
    storage = storage_for(path)
    try:
        yield
    except storage.failures as exc:
        advice = storage.advice(path, exc)
        if advice is None:
            raise
        raise CheckpointError(f"cannot {doing} {path}: {advice}") from exc


def _on_rank_zero(target: Location, work: Callable[[], None]) -> None:
    """Run ``work`` on rank 0 and raise what it raised on every rank (collective): the
    others would otherwise wait for it forever."""
    problem: Exception | None = None
    if is_rank_zero():
        try:
            work()
        except (FileExistsError, CheckpointError, ValueError) as exc:
            problem = exc
        except Exception as exc:
            problem = CheckpointError(f"cannot write the export to {target}: "
                                      f"{storage_for(target).explain(target, exc)}")
            problem.__cause__ = exc
    problem = from_rank_zero(problem)
    if problem is not None:
        raise problem


def _write_hf(reader: Any, model: str, tensors: dict[str, Any], dtype: torch.dtype | None,
              map_key: KeyMap | None, max_shard_bytes: int, staging: Staging,
              rules: Mapping[str, StackedKey]) -> None:
    """Write ``model``'s shards, and their index if several, into ``staging``."""
    parts = exported_parts(model, tensors, rules, map_key)  # exported key -> its part
    sizes = {key: _exported_bytes(tensors[part.key], dtype, part)
             for key, part in parts.items()}
    shards = plan_shards(sizes, max_shard_bytes)
    for keys, file_name in zip(shards, shard_file_names(len(shards))):
        write_file(reader, model, {key: parts[key] for key in keys}, tensors, dtype,
                    staging, file_name)
    if len(shards) > 1:
        write_index(staging, shards, sizes)


def write_file(reader: Any, model: str, keys: dict[str, Part], tensors: dict[str, Any],
                dtype: torch.dtype | None, staging: Staging, name: str) -> None:
    """Read the tensors ``keys`` takes parts of (exported key -> part) and save the parts
    as the new file ``name`` of ``staging``."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    loaded = {name: torch.empty(tensors[name].size, dtype=tensors[name].properties.dtype)
              for name in {part.key for part in keys.values()}}
    with warnings.catch_warnings():
        # Loading in one process is the point here; DCP warns that it assumes so.
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        try:
            dcp.load({f"{MODEL_PREFIX}{model}.{name}": tensor
                      for name, tensor in loaded.items()}, storage_reader=reader, no_dist=True)
        except CheckpointException as exc:
            # DCP gathers the failure by rank ("ranks:dict_keys([0])"); the reader's own
            # error names the file and what is wrong.
            raise load_failure(exc, f"cannot read the weights of model {model!r} from "
                                    f"{reader.directory}") from exc
    out = {key: _cast(part.take(loaded[part.key]), dtype).contiguous()
           for key, part in keys.items()}
    # transformers checks the "format" entry of the header to know the framework.
    staging.save_tensors(name, out, metadata={"format": "pt"})


def _cast(tensor: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    return tensor.to(dtype) if dtype is not None and tensor.is_floating_point() else tensor


def _exported_bytes(entry: Any, dtype: torch.dtype | None, part: Part) -> int:
    """The bytes of the exported ``part`` of the tensor ``entry`` describes."""
    stored = entry.properties.dtype
    element = (dtype if dtype is not None and stored.is_floating_point else stored).itemsize
    return element * int(torch.Size(part.shape(entry.size)).numel())
