"""Turning a (sharded) checkpoint into one safetensors file of weights per model."""

from __future__ import annotations

import warnings
from pathlib import Path

import torch

from dream_trainer.checkpoint.layout import CheckpointError, is_complete, verify_files


def export_checkpoint(checkpoint: str | Path, out_dir: str | Path) -> dict[str, Path]:
    """Write ``<out_dir>/<model>.safetensors`` for every model in ``checkpoint``.

    Runs in one process, without a process group, whatever number of ranks wrote the
    checkpoint; only the model weights are read (peak memory: the largest model). The files
    load into a plain ``nn.Module`` with ``safetensors.torch.load_file`` and
    ``load_state_dict``.

    Returns:
        The written file of each model, by model name.

    Raises:
        CheckpointError: if the checkpoint is incomplete or damaged.
    """
    # Imported here: torch.distributed.checkpoint takes about a second to import.
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import save_file
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    checkpoint, out_dir = Path(checkpoint), Path(out_dir)
    if not is_complete(checkpoint):
        raise CheckpointError(f"{checkpoint} is not a complete dream_trainer checkpoint")
    reader = dcp.FileSystemReader(str(checkpoint))
    metadata = reader.read_metadata()
    verify_files(checkpoint, metadata)
    models: dict[str, dict[str, torch.Tensor]] = {}
    for key, entry in metadata.state_dict_metadata.items():
        parts = key.split(".", 2)
        if parts[0] == "state" and len(parts) == 3 and parts[1] == "models" \
                and isinstance(entry, TensorStorageMetadata):
            model, _, name = parts[2].partition(".")
            models.setdefault(model, {})[name] = torch.empty(entry.size,
                                                             dtype=entry.properties.dtype)
    if not models:
        raise CheckpointError(f"{checkpoint} holds no model weights")
    flat = {f"state.models.{model}.{name}": tensor
            for model, tensors in models.items() for name, tensor in tensors.items()}
    with warnings.catch_warnings():
        # Loading in one process is the point here; DCP warns that it assumes so.
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(flat, storage_reader=reader, no_dist=True)
    out_dir.mkdir(parents=True, exist_ok=True)
    written = {}
    for model, tensors in models.items():
        path = out_dir / f"{model}.safetensors"
        save_file({name: tensor.contiguous() for name, tensor in tensors.items()}, str(path))
        written[model] = path
    return written
