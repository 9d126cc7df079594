"""Finding the repeated blocks of a model: the unit of sharding, compilation, recomputation."""

from __future__ import annotations

from torch import nn

# A ModuleDict holds torchtitan's layers ({"0": block, "1": block, ...}).
_CONTAINERS = (nn.ModuleList, nn.Sequential, nn.ModuleDict)


def find_blocks(model: nn.Module) -> list[tuple[nn.Module, str, nn.Module]]:
    """Children with parameters of the outermost ``ModuleList``/``Sequential``/``ModuleDict``
    containers.

    Returns ``(container, name, block)`` triples, so a caller can replace a block in place with
    ``setattr(container, name, new_block)``. Containers inside a block are not searched: the
    block is the unit. A model that is itself a container yields its own children.
    """
    if isinstance(model, _CONTAINERS):
        return [(model, name, child) for name, child in model.named_children()
                if any(True for _ in child.parameters())]
    blocks: list[tuple[nn.Module, str, nn.Module]] = []
    for child in model.children():
        blocks.extend(find_blocks(child))
    return blocks
