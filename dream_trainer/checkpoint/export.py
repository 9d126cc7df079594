"""Turning a (sharded) checkpoint into safetensors weights: one file per model, or the
Hugging Face layout (written with ``dream_trainer.weights.hf``)."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from dream_trainer.checkpoint.layout import (METADATA, MODEL_PREFIX, CheckpointError,
                                             is_complete, verify_files)
from dream_trainer.checkpoint.trust import safe_reader
from dream_trainer.utils.paths import component_problem
from dream_trainer.weights.hf import (DEFAULT_MAX_SHARD_BYTES, ExportFormat, check_out_dir,
                                      export_paths, exported_names, plan_shards,
                                      replace_weights, shard_file_names, write_index)


def export_checkpoint(checkpoint: str | Path, out_dir: str | Path,
                      format: ExportFormat = "safetensors", dtype: torch.dtype | None = None,
                      map_key: Callable[[str, str], str | None] | None = None,
                      max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
                      overwrite: bool = False) -> dict[str, Path]:
    """Write the weights of every model in ``checkpoint`` as safetensors, inside ``out_dir``.

    ``"safetensors"`` writes ``<out_dir>/<model>.safetensors`` with the model's own keys.
    ``"hf"`` writes the Hugging Face layout: ``model.safetensors``, or shards of at most
    ``max_shard_bytes`` with ``model.safetensors.index.json``, keyed by ``map_key``; in
    ``out_dir`` itself for a checkpoint of one model, else in ``<out_dir>/<model>/``. Runs in
    one process, without a process group, whatever number of ranks wrote the checkpoint; only
    model weights are read, one output file at a time (peak memory: the largest file).

    Args:
        checkpoint: A complete ``step_<N>`` checkpoint directory.
        out_dir: Where to write; created when missing. It must be empty unless
            ``overwrite`` is set.
        format: ``"safetensors"`` or ``"hf"``.
        dtype: Cast floating tensors to it (``torch.bfloat16``); None keeps the saved dtype.
        map_key: ``(model name, key) -> exported key`` (None leaves the key out); ``"hf"``
            only. ``trainer.map_exported_key`` is the usual one.
        max_shard_bytes: Largest shard of an ``"hf"`` export.
        overwrite: Export into a non-empty ``out_dir``: the weight files of an earlier export
            there are replaced once the new ones are written; other files stay.

    Returns:
        The written file (``"safetensors"``) or directory (``"hf"``) of each model.

    Raises:
        CheckpointError: if the checkpoint is incomplete or damaged, holds no weights, or
            names a model that is not a plain file name.
        FileExistsError: if ``out_dir`` is not empty and ``overwrite`` is False.
        ValueError: for an unknown format, or two keys mapped to the same name.
    """
    if format not in ("hf", "safetensors"):
        raise ValueError(f"format={format!r}: expected 'safetensors' (one file per model) or "
                         "'hf' (the Hugging Face layout)")
    checkpoint, out_dir = Path(checkpoint), Path(out_dir)
    if not is_complete(checkpoint):
        raise CheckpointError(f"{checkpoint} is not a complete dream_trainer checkpoint")
    check_out_dir(out_dir, overwrite)  # before the checksums, which may take minutes
    reader = safe_reader(str(checkpoint))
    metadata = reader.read_metadata()
    verify_files(checkpoint, metadata)
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
    written = {}
    for model, tensors in models.items():
        target, staging = export_paths(out_dir, model, format, several=len(models) > 1,
                                       make_room=True)
        if format == "safetensors":
            _write_file(reader, model, {name: name for name in tensors}, tensors, dtype,
                        staging / target.name)
            (staging / target.name).replace(target)  # a failed write leaves the old file whole
            staging.rmdir()
        else:
            _write_hf(reader, model, tensors, dtype, map_key, max_shard_bytes, target, staging)
        written[model] = target
    return written


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


def _write_hf(reader: Any, model: str, tensors: dict[str, Any], dtype: torch.dtype | None,
              map_key: Callable[[str, str], str | None] | None, max_shard_bytes: int,
              target: Path, staging: Path) -> None:
    renamed = exported_names(model, tensors, map_key)  # exported key -> checkpoint key
    sizes = {key: _exported_bytes(tensors[name], dtype) for key, name in renamed.items()}
    shards = plan_shards(sizes, max_shard_bytes)
    for keys, file_name in zip(shards, shard_file_names(len(shards))):
        _write_file(reader, model, {key: renamed[key] for key in keys}, tensors, dtype,
                    staging / file_name)
    if len(shards) > 1:
        write_index(staging, shards, sizes)
    replace_weights(staging, target)


def _write_file(reader: Any, model: str, keys: dict[str, str], tensors: dict[str, Any],
                dtype: torch.dtype | None, path: Path) -> None:
    """Read the tensors ``keys`` names (exported key -> checkpoint key) and save them."""
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import save_file

    loaded = {name: torch.empty(tensors[name].size, dtype=tensors[name].properties.dtype)
              for name in keys.values()}
    with warnings.catch_warnings():
        # Loading in one process is the point here; DCP warns that it assumes so.
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load({f"{MODEL_PREFIX}{model}.{name}": tensor for name, tensor in loaded.items()},
                 storage_reader=reader, no_dist=True)
    out = {key: _cast(loaded[name], dtype).contiguous() for key, name in keys.items()}
    path.parent.mkdir(parents=True, exist_ok=True)
    # transformers checks the "format" entry of the header to know the framework.
    save_file(out, str(path), metadata={"format": "pt"})


def _cast(tensor: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    return tensor.to(dtype) if dtype is not None and tensor.is_floating_point() else tensor


def _exported_bytes(entry: Any, dtype: torch.dtype | None) -> int:
    stored = entry.properties.dtype
    element = (dtype if dtype is not None and stored.is_floating_point else stored).itemsize
    return element * int(torch.Size(entry.size).numel())
