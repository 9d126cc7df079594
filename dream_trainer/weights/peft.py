"""``export_weights(format="peft")``: a peft model's LoRA adapters as ``PeftModel.from_pretrained``
loads them, from a running trainer of any layout (a pipeline's stages gathered on rank 0).

The directory holds ``adapter_model.safetensors`` (the adapters, whole, under peft's keys: the
parameter names without the adapter's name, as ``get_peft_model_state_dict`` gives them) and
``adapter_config.json`` (the adapter's ``LoraConfig``). peft is never imported: its models
are recognized by their package and their config writes itself (``to_dict``).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from dream_trainer.parallel.dtensor import full_value
from dream_trainer.parallel.lora import is_peft_model
from dream_trainer.parallel.names import clean_name, unwrap_ddp
from dream_trainer.parallel.pipeline import PipelineStages, unwrap_stage
from dream_trainer.weights.hf import Files, check_out_dir_on_rank_zero, replace_weights
from dream_trainer.weights.peft_sources import (ADAPTER_CONFIG, ADAPTER_PART, ADAPTER_WEIGHTS,
                                                config_json)
from dream_trainer.weights.staging import Staging
from dream_trainer.world.agree import barrier, is_distributed, is_rank_zero

logger = logging.getLogger(__name__)



def export_adapters(models: Mapping[str, nn.Module], path: Path, dtype: torch.dtype | None,
                    files: Files, overwrite: bool = False) -> dict[str, Path]:
    """Write each peft model's adapters to ``path`` (``path/<model>`` with several models),
    collectively: every rank takes part in gathering sharded adapters, rank 0 writes.

    Returns:
        The directory written for each model.

    Raises:
        ValueError: on every rank, for a model that is not a peft model or one with several
            adapters.
        FileExistsError: on every rank, if ``path`` is not empty and ``overwrite`` is False.
    """
    roots = {name: unwrap_ddp(model) for name, model in models.items()}
    for name, root in roots.items():
        _check(name, _peft_model(root))
    check_out_dir_on_rank_zero(path, overwrite, files)
    written = {}
    for name, root in roots.items():
        (adapter, config), = _peft_model(root).peft_config.items()
        tensors = adapter_tensors(root, adapter, dtype)  # collective under FSDP2
        if isinstance(root, PipelineStages):
            tensors = _on_rank_zero(tensors)
        target = path if len(roots) == 1 else path / name
        if is_rank_zero():
            staging = Staging(path, name)
            try:
                with staging:  # emptied and removed if writing fails
                    staging.save_tensors(ADAPTER_WEIGHTS, tensors, {"format": "pt"})
                    staging.write(ADAPTER_CONFIG, config_json(config.to_dict()))
                    replace_weights(staging, target)
            finally:
                staging.close()
        barrier()
        logger.info("exported the %s adapter of %s to %s", adapter, name, target)
        written[name] = target
    return written


def adapter_tensors(model: nn.Module, adapter: str,
                    dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """The adapter's parameters of ``model``, whole and contiguous, under peft's keys."""
    tensors = {}
    for name, param in model.named_parameters():
        key = clean_name(name)
        match = ADAPTER_PART.search(key)
        if match is None or match.group(2) != adapter:
            continue
        value = full_value(param.detach())
        if dtype is not None and value.is_floating_point():
            value = value.to(dtype)
        tensors[key[:match.start(2) - 1] + key[match.end(2):]] = value.contiguous().cpu()
    return tensors


def _peft_model(root: nn.Module) -> nn.Module:
    """The peft model of ``root``: itself, or for a pipeline its first stage held here (each
    stage of a peft model is a peft model with the same config, holding part of it)."""
    return unwrap_stage(root.stages[0]) if isinstance(root, PipelineStages) else root


def _on_rank_zero(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The union of every rank's ``tensors`` on rank 0 (empty elsewhere; collective): a
    pipeline rank holds its stages' adapters only."""
    import torch.distributed as dist

    if not is_distributed():
        return tensors
    pieces: list[Any] = [None] * dist.get_world_size() if is_rank_zero() else []
    dist.gather_object(tensors, pieces if is_rank_zero() else None, dst=0)
    return {key: value for piece in pieces for key, value in piece.items()}


def _check(name: str, root: nn.Module) -> None:
    if not is_peft_model(root):
        raise ValueError(f"format='peft' writes the LoRA adapters of a peft model, but the "
                         f"model {name!r} is a {type(root).__name__}: wrap it with "
                         "peft.get_peft_model in configure_models, or export format='hf'")
    if len(root.peft_config) != 1:
        raise ValueError(f"format='peft' writes one adapter, but the model {name!r} holds "
                         f"{sorted(root.peft_config)}: delete the others "
                         "(model.delete_adapter) before exporting")
