"""Model tensors that files hold as several tensors: the ``StackedKey`` rules of a model, the
boxes of file tensors that fill a rank's shard of a stacked parameter (read by
``hf_reader.BoxPlanner``), and the split back.

``replace_hf_moe_blocks`` declares the rules of each layer it makes (its files' layout,
``nn.hf_moe``); ``init_weights_from`` reads each expert's file tensor into the rows of the
stacked parameter this rank holds (under expert parallelism and FSDP2 only its experts'),
and an ``"hf"`` export writes every expert as a tensor of its own again.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from dream_trainer.nn.hf_moe import FILE_LAYOUTS, HF_FILE_LAYOUT, StackedKey
from dream_trainer.nn.moe import MoE
from dream_trainer.parallel.dtensor import is_dtensor
from dream_trainer.parallel.names import clean_name, unwrap_ddp

Box = tuple[list[int], torch.Tensor]
"""Where a target lies in a file tensor (its offsets) and the target (a view of a shard)."""


@dataclass(frozen=True)
class Part:
    """One exported tensor: the model tensor ``key``, or its slice ``index`` along the first
    dimension, its last two dimensions swapped when ``transposed``."""

    key: str
    index: int | None = None
    transposed: bool = False

    def take(self, tensor: torch.Tensor) -> torch.Tensor:
        """This part of ``tensor`` (the whole model tensor)."""
        if self.index is None:
            return tensor
        piece = tensor[self.index]
        return piece.transpose(-2, -1) if self.transposed else piece


def model_rules(model: nn.Module) -> dict[str, StackedKey]:
    """Model key -> rule, for the layers of ``model`` that carry a file layout."""
    rules: dict[str, StackedKey] = {}
    for name, module in unwrap_ddp(model).named_modules():
        layout = getattr(module, HF_FILE_LAYOUT, None)
        if isinstance(module, MoE) and layout is not None:
            rules.update((rule.key, rule)
                         for rule in layout.keys(clean_name(name), module.num_experts))
    return rules


def checkpoint_rules(shapes: Mapping[str, Any], model_type: str | None) -> dict[str, StackedKey]:
    """Model key -> rule, for the ``MoE`` layers among a checkpoint's keys (``shapes``: key ->
    size), written in the files of ``model_type`` (None: no rules).

    Raises:
        ValueError: if the checkpoint holds ``MoE`` layers and ``model_type`` has no declared
            file layout.
    """
    suffix = ".experts.w1"
    layers = [key.removesuffix(suffix) for key in shapes if key.endswith(suffix)
              and f"{key.removesuffix(suffix)}.router.weight" in shapes]
    if model_type is None or not layers:
        return {}
    layout = FILE_LAYOUTS.get(model_type)
    if layout is None:
        raise ValueError(f"model_type={model_type!r} has no declared file layout for its "
                         f"mixture-of-experts layers ({', '.join(layers[:3])}); the types with "
                         f"one are {', '.join(FILE_LAYOUTS)}")
    return {rule.key: rule for layer in layers
            for rule in layout.keys(layer, int(shapes[f"{layer}{suffix}"][0]))}


def split_names(keys: Iterable[str], rules: Mapping[str, StackedKey]) -> dict[str, Part]:
    """``{file key (before renaming): Part}`` for the model tensors ``keys``: a stacked
    tensor becomes one part per slice, a renamed one takes its file name."""
    parts: dict[str, Part] = {}
    for key in keys:
        rule = rules.get(key)
        if rule is None:
            parts[key] = Part(key)
        elif not rule.stacked:
            parts[rule.parts[0]] = Part(key)
        else:
            parts.update((part, Part(key, index, rule.transposed))
                         for index, part in enumerate(rule.parts))
    return parts


def split_local(state: Mapping[str, torch.Tensor],
                rules: Mapping[str, StackedKey]) -> dict[str, torch.Tensor]:
    """``state`` (a rank's view, sharded as the model is) keyed as the files are before
    renaming: each slice of a stacked tensor that this rank holds becomes a tensor of its own
    (a contiguous copy); a rank holding no slice of it contributes none.

    Raises:
        ValueError: if a stacked tensor is sharded along a dimension other than the first.
    """
    out: dict[str, torch.Tensor] = {}
    for key, tensor in state.items():
        rule = rules.get(key)
        if rule is None:
            out[key] = tensor
        elif not rule.stacked:
            out[rule.parts[0]] = tensor
        else:
            offsets, local = local_box(tensor)
            if tuple(local.shape[1:]) != tuple(tensor.shape[1:]):
                raise ValueError(f"{key} is sharded along a dimension other than its first "
                                 f"(this rank holds {tuple(local.shape)} of "
                                 f"{tuple(tensor.shape)}): its slices cannot be exported one "
                                 "per file tensor; shard it along its first dimension")
            for row in range(local.shape[0]):
                part = Part(key, row, rule.transposed).take(local)
                out[rule.parts[offsets[0] + row]] = part.contiguous()
    return out


def local_box(tensor: torch.Tensor) -> Box:
    """The offsets of this rank's shard of ``tensor`` in the whole tensor, and the shard."""
    if is_dtensor(tensor):
        chunk = tensor.__create_chunk_list__()[0]  # type: ignore[attr-defined]
        return list(chunk.offsets), tensor.to_local()
    return [0] * tensor.dim(), tensor


def stacked_boxes(tensor: torch.Tensor, rule: StackedKey,
                  storage_keys: Mapping[int, str]) -> dict[str, Box]:
    """``{storage key: box}``: for each slice of ``tensor`` that this rank holds, where its
    part of the slice lies in that slice's file tensor, and the view to read it into."""
    offsets, local = local_box(tensor)
    boxes: dict[str, Box] = {}
    for row in range(local.shape[0]):
        target, inner = local[row], offsets[1:]
        if rule.transposed:
            target, inner = target.transpose(-2, -1), [*inner[:-2], inner[-1], inner[-2]]
        boxes[storage_keys[offsets[0] + row]] = (inner, target)
    return boxes
