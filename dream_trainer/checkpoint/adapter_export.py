"""``dream-trainer export --format peft``: a checkpoint's LoRA adapters as peft saves them, in
one process, from the checkpoint alone.

The checkpoint holds the adapters' tensors (under the model's keys,
``...q_proj.lora_A.default.weight``) and, in ``models.json``, the adapter's config
(``checkpoint.frozen``). Each peft model gets ``adapter_model.safetensors`` (peft's keys: the
adapter's name left out) and ``adapter_config.json``: what ``PeftModel.from_pretrained``
loads onto the base.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from dream_trainer.checkpoint.directory import RECORD, CheckpointError, is_complete, verify_files
from dream_trainer.checkpoint.export import model_tensors, write_file
from dream_trainer.checkpoint.models_record import read_record
from dream_trainer.checkpoint.storage import location, storage_for
from dream_trainer.checkpoint.storage_base import Location, below
from dream_trainer.checkpoint.trust import safe_reader
from dream_trainer.weights.hf import check_out_dir, is_weight_file, replace_weights
from dream_trainer.weights.peft_sources import (ADAPTER_CONFIG, ADAPTER_PART, ADAPTER_WEIGHTS,
                                                config_json)
from dream_trainer.weights.stacked import Part
from dream_trainer.weights.staging import Staging


def export_checkpoint_adapters(checkpoint: str | Path | Location, out_dir: str | Path | Location,
                               dtype: torch.dtype | None = None,
                               overwrite: bool = False) -> dict[str, Location]:
    """Write the LoRA adapter of every peft model in ``checkpoint`` inside ``out_dir``
    (``out_dir/<model>`` with several).

    Returns:
        The directory written for each model.

    Raises:
        CheckpointError: for an incomplete or damaged checkpoint, one that records no peft
            model (naming ``models.json`` and the fix), or a model with several adapters.
        FileExistsError: if ``out_dir`` is not empty and ``overwrite`` is False.
    """
    checkpoint, out_dir = location(checkpoint), location(out_dir)
    if not is_complete(checkpoint):
        raise CheckpointError(f"{checkpoint} is not a complete dream_trainer checkpoint")
    check_out_dir(out_dir, overwrite, storage_for(out_dir))
    reader = safe_reader(checkpoint)
    metadata = reader.read_metadata()
    verify_files(checkpoint, metadata)
    _, adapters = read_record(checkpoint)
    if not adapters:
        raise CheckpointError(
            f"{checkpoint} records no peft model ({RECORD} holds no adapter config): "
            "--format peft writes the adapters of a model wrapped by peft.get_peft_model, "
            "from a checkpoint written by this version; export it with --format hf")
    models = model_tensors(metadata)
    written: dict[str, Location] = {}
    with storage_for(out_dir).local_dir(out_dir, is_weight_file) as local:
        for model, configs in adapters.items():
            if len(configs) != 1:
                raise CheckpointError(f"model {model!r} of {checkpoint} holds the adapters "
                                      f"{sorted(configs)}: --format peft writes one")
            (adapter, config), = configs.items()
            parts = _adapter_parts(models.get(model, {}), adapter)
            if not parts:
                raise CheckpointError(f"{checkpoint} holds no tensor of the adapter "
                                      f"{adapter!r} of model {model!r}")
            target = local if len(adapters) == 1 else local / model
            with Staging(local, model) as staging:
                write_file(reader, model, parts, models[model], dtype, staging,
                           ADAPTER_WEIGHTS)
                staging.write(ADAPTER_CONFIG, config_json(config))
                replace_weights(staging, target)
            written[model] = out_dir if target == local else below(out_dir, model)
    return written


def _adapter_parts(tensors: dict[str, Any], adapter: str) -> dict[str, Part]:
    """peft's key -> the model tensor, for the adapter's tensors among ``tensors``."""
    parts = {}
    for key in tensors:
        match = ADAPTER_PART.search(key)
        if match is not None and match.group(2) == adapter:
            parts[key[:match.start(2) - 1] + key[match.end(2):]] = Part(key)
    return parts
