"""Expert parallelism for ``dream_trainer.nn.MoE`` layers: their routed experts split over the
``ep`` mesh axis, then sharded by FSDP2 over the data-parallel ranks left (``efsdp``)."""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from dream_trainer.nn.moe import moe_layers


def distribute_experts(model: nn.Module, ep_mesh: DeviceMesh) -> int:
    """Split the routed experts of every ``MoE`` layer of ``model`` over ``ep_mesh``: each
    stacked expert weight becomes a DTensor sharded on its expert dimension (``Shard(0)``), and
    the layer exchanges its tokens with the other ranks of the mesh. Works on the meta device,
    before materialization. Returns how many layers it split.

    Raises:
        ValueError: if a layer's ``num_experts`` is not a multiple of the mesh size.
    """
    from torch.distributed.tensor import Shard, distribute_tensor

    ranks = ep_mesh.size()
    layers = list(moe_layers(model))
    for name, layer in ((name, module) for name, module in model.named_modules()
                        if module in layers):
        if layer.num_experts % ranks:
            raise ValueError(f"MoE layer {name!r} has num_experts={layer.num_experts}, which "
                             f"expert_parallel={ranks} does not divide: each rank must hold "
                             "the same number of experts; change one of them")
        for weight_name, weight in list(layer.experts.named_parameters(recurse=False)):
            sharded = distribute_tensor(weight.data, ep_mesh, [Shard(0)])
            setattr(layer.experts, weight_name,
                    nn.Parameter(sharded, requires_grad=weight.requires_grad))
        layer.ep_group = ep_mesh.get_group()
    return len(layers)


def fully_shard_experts(model: nn.Module, efsdp_mesh: DeviceMesh, config: dict[str, Any]) -> None:
    """Shard the (expert-parallel) experts of every ``MoE`` layer of ``model`` with FSDP2 over
    ``efsdp_mesh``, before the blocks holding them are sharded over all of ``dp_shard``: FSDP2
    then leaves these weights to this inner unit. ``config`` is ``fully_shard``'s keyword
    arguments; its mesh is replaced."""
    from torch.distributed.fsdp import fully_shard

    for layer in moe_layers(model):
        if layer.ep_group is not None:
            fully_shard(layer.experts, **{**config, "mesh": efsdp_mesh})
