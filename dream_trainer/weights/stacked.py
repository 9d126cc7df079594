"""Model tensors that files hold as several tensors: the ``StackedKey`` rules of a model, the
boxes of file tensors that fill a rank's shard of a stacked parameter (read by
``hf_reader.BoxPlanner``), and the split back.

``replace_hf_moe_blocks`` declares the rules of each layer it makes (its files' layout,
``nn.hf_moe``), and transformers' own blocks of a declared model type get theirs from the
same layout; ``init_weights_from`` reads each expert's file tensor into the rows of the
stacked parameter this rank holds (under expert parallelism and FSDP2 only its experts'),
and an ``"hf"`` export writes every expert as a tensor of its own again. A key map's
transpose (``TransformedKey``) is read the same way, as one box of a file tensor.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from dream_trainer.nn.hf_moe import FILE_LAYOUTS, HF_FILE_LAYOUT, StackedKey, is_hf_moe_block
from dream_trainer.nn.moe import MoE
from dream_trainer.parallel.dtensor import is_dtensor
from dream_trainer.parallel.names import clean_name, unwrap_ddp
from dream_trainer.weights.keys import KeyMap, TransformedKey, exported_names

Box = tuple[list[int], torch.Tensor]
"""Where a target lies in a file tensor (its offsets) and the target (a view of a shard)."""

@dataclass(frozen=True)
class Part:
    """One exported tensor: the model tensor ``key``, or its slice ``index`` along the first
    dimension (of which the ``chunk``-th of ``chunks`` equal pieces along the slice's first
    dimension, its last two dimensions swapped when ``transposed``); then ``transform``'s
    ``file_tensor`` when a key map gave one."""

    key: str
    index: int | None = None
    transposed: bool = False
    chunk: int = 0
    chunks: int = 1
    transform: TransformedKey | None = None

    def take(self, tensor: torch.Tensor) -> torch.Tensor:
        """This part of ``tensor`` (the whole model tensor)."""
        piece = tensor
        if self.index is not None:
            piece = tensor[self.index]
            if self.chunks > 1:
                piece = piece.chunk(self.chunks)[self.chunk]
            if self.transposed:
                piece = piece.transpose(-2, -1)
        return piece if self.transform is None else self.transform.file_tensor(piece)

    def shape(self, size: Iterable[int]) -> tuple[int, ...]:
        """The shape of this part of a model tensor of ``size``."""
        shape = tuple(size)
        if self.index is not None:
            shape = (shape[1] // self.chunks, *shape[2:])
            if self.transposed:
                shape = (*shape[:-2], shape[-1], shape[-2])
        return shape if self.transform is None else self.transform.file_shape(shape)


def model_rules(model: nn.Module) -> dict[str, StackedKey]:
    """Model key -> rule, for the layers of ``model`` whose files hold their tensors as
    several: ``MoE`` layers that carry a file layout, and transformers' own MoE blocks of a
    model type of ``FILE_LAYOUTS`` (the type of the nearest module above them with a
    ``config``)."""
    rules: dict[str, StackedKey] = {}
    types: dict[str, str] = {}  # module name -> model_type of its config
    for name, module in unwrap_ddp(model).named_modules():
        model_type = getattr(getattr(module, "config", None), "model_type", None)
        if isinstance(model_type, str):
            types[name] = model_type
        layout = getattr(module, HF_FILE_LAYOUT, None)
        if isinstance(module, MoE) and layout is not None:
            rules.update((rule.key, rule)
                         for rule in layout.keys(clean_name(name), module.num_experts))
        elif is_hf_moe_block(module):
            layout = FILE_LAYOUTS.get(_nearest(types, name))  # type: ignore[arg-type]
            if layout is not None:
                num_experts = module.experts.gate_up_proj.shape[0]
                rules.update((rule.key, rule)
                             for rule in layout.block_keys(clean_name(name), num_experts))
    return rules


def _nearest(types: Mapping[str, str], name: str) -> str | None:
    """The model type recorded for ``name`` or its closest ancestor."""
    while True:
        if name in types:
            return types[name]
        if not name:
            return None
        name = name.rpartition(".")[0]


def checkpoint_rules(shapes: Mapping[str, Any], model_type: str | None) -> dict[str, StackedKey]:
    """Model key -> rule, for the MoE layers among a checkpoint's keys (``shapes``: key ->
    size), written in the files of ``model_type`` (None: no rules): ``MoE`` layers, and
    transformers' own blocks (``experts.gate_up_proj``), which a type without a declared
    layout keeps stacked, as transformers' own models hold them.

    Raises:
        ValueError: if the checkpoint holds ``MoE`` layers and ``model_type`` has no declared
            file layout, or a stacked tensor whose experts are empty or differ in number.
    """
    suffix, own = ".experts.w1", ".experts.gate_up_proj"
    layers = [key.removesuffix(suffix) for key in shapes if key.endswith(suffix)
              and f"{key.removesuffix(suffix)}.router.weight" in shapes]
    blocks = [key.removesuffix(own) for key in shapes if key.endswith(own)
              and f"{key.removesuffix(own)}.experts.down_proj" in shapes]
    if model_type is None or not (layers or blocks):
        return {}
    layout = FILE_LAYOUTS.get(model_type)
    if layout is None and layers:
        raise ValueError(f"model_type={model_type!r} has no declared file layout for its "
                         f"mixture-of-experts layers ({', '.join(layers[:3])}); the types with "
                         f"one are {', '.join(FILE_LAYOUTS)}")
    if layout is None:
        return {}
    rules = [rule for layer in layers for rule in layout.keys(
        layer, _experts(shapes, layer, (suffix, ".experts.w2", ".experts.w3")))]
    rules += [rule for block in blocks for rule in layout.block_keys(
        block, _experts(shapes, block, (own, ".experts.down_proj")))]
    return {rule.key: rule for rule in rules}


def _experts(shapes: Mapping[str, Any], layer: str, suffixes: tuple[str, ...]) -> int:
    """The number of experts the stacked tensors ``layer + suffix`` hold (their first
    dimension), each becoming one file tensor per expert.

    Each expert must hold elements: the checkpoint's stored bytes then bound the count (its
    declared sizes are checked against them when read), where a tensor of a billion empty
    experts would cost a billion file keys and no byte.

    Raises:
        ValueError: naming the tensor, if it is not stacked, its experts hold no element, or
            the tensors differ in their number of experts.
    """
    counts = {}
    for key in (f"{layer}{suffix}" for suffix in suffixes if f"{layer}{suffix}" in shapes):
        shape = [int(n) for n in shapes[key]]
        if len(shape) < 2 or math.prod(shape[1:]) == 0:
            raise ValueError(f"{key} {shape} stacks experts that hold no element: it "
                             "cannot be exported as one tensor per expert. The checkpoint "
                             "was altered or crafted; do not use it")
        counts[key] = shape[0]
    if len(set(counts.values())) > 1:
        raise ValueError(f"the stacked expert tensors of {layer} differ in their number of "
                         f"experts ({counts}): the checkpoint was altered or crafted; do not "
                         "use it")
    return next(iter(counts.values()))


def split_names(keys: Iterable[str], rules: Mapping[str, StackedKey]) -> dict[str, Part]:
    """``{file key (before renaming): Part}`` for the model tensors ``keys``: a stacked
    tensor becomes one part per file tensor, a renamed one takes its file name."""
    parts: dict[str, Part] = {}
    for key in keys:
        rule = rules.get(key)
        if rule is None:
            parts[key] = Part(key)
        elif not rule.stacked:
            parts[rule.parts[0]] = Part(key)
        else:
            parts.update((part, Part(key, index // rule.concat, rule.transposed,
                                     index % rule.concat, rule.concat))
                         for index, part in enumerate(rule.parts))
    return parts


def exported_parts(model: str, keys: Iterable[str], rules: Mapping[str, StackedKey],
                   map_key: KeyMap | None) -> dict[str, Part]:
    """``{exported key: Part}`` for the model tensors ``keys``: split as ``rules`` say, then
    each file key through ``map_key`` (None drops it; a ``TransformedKey`` names the
    exported key and transforms the part).

    Raises:
        ValueError: if two keys map to the same exported key.
    """
    parts = split_names(keys, rules)
    return {target: replace(parts[name], transform=transform)
            for target, (name, transform) in exported_names(model, parts, map_key).items()}


def split_local(state: Mapping[str, torch.Tensor],
                rules: Mapping[str, StackedKey]) -> dict[str, torch.Tensor]:
    """``state`` (a rank's view, sharded as the model is) keyed as the files are before
    renaming: each slice of a stacked tensor that this rank holds becomes its file tensors
    (contiguous copies); a rank holding no slice of it contributes none.

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
                for chunk in range(rule.concat):
                    part = Part(key, row, rule.transposed, chunk, rule.concat).take(local)
                    out[rule.parts[(offsets[0] + row) * rule.concat + chunk]] = \
                        part.contiguous()
    return out


def local_box(tensor: torch.Tensor) -> Box:
    """The offsets of this rank's shard of ``tensor`` in the whole tensor, and the shard."""
    if is_dtensor(tensor):
        chunk = tensor.__create_chunk_list__()[0]  # type: ignore[attr-defined]
        return list(chunk.offsets), tensor.to_local()
    return [0] * tensor.dim(), tensor


def stacked_boxes(tensor: torch.Tensor, rule: StackedKey,
                  storage_keys: Mapping[int, str]) -> dict[str, Box]:
    """``{storage key: box}``: for each file tensor that fills a part of this rank's shard
    of ``tensor`` (its slices, and of each the rows a part covers), where that part lies in
    the file tensor, and the view to read it into."""
    offsets, local = local_box(tensor)
    rows = tensor.shape[1] // rule.concat  # of each part, along the slice's first dimension
    boxes: dict[str, Box] = {}
    for row in range(local.shape[0]):
        target, inner = local[row], offsets[1:]
        for chunk in range(rule.concat):
            start = max(inner[0], chunk * rows)
            end = min(inner[0] + target.shape[0], (chunk + 1) * rows)
            if start >= end:
                continue  # this rank's shard holds none of this part
            piece = target.narrow(0, start - inner[0], end - start)
            within = [start - chunk * rows, *inner[1:]]
            if rule.transposed:
                piece, within = piece.transpose(-2, -1), [*within[:-2], within[-1], within[-2]]
            boxes[storage_keys[(offsets[0] + row) * rule.concat + chunk]] = (within, piece)
    return boxes


def transposed_box(tensor: torch.Tensor, dims: tuple[int, int]) -> Box:
    """The box of a file tensor that holds ``tensor`` with ``dims`` swapped: where this
    rank's shard lies in it, and the shard's view to read it into."""
    offsets, local = local_box(tensor)
    first, second = dims
    offsets[first], offsets[second] = offsets[second], offsets[first]
    return offsets, local.transpose(first, second)
