"""Expert parallelism for ``dream_trainer.nn.MoE`` layers: their routed experts split over the
``ep`` mesh axis, then sharded by FSDP2 over the data-parallel ranks left (``efsdp``)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from dream_trainer.nn.moe import GroupedExperts, moe_layers
from dream_trainer.world.agree import agree_any
from dream_trainer.world.dims import MeshAxis
from dream_trainer.world.world import DistributedWorld


def distribute_experts(model: nn.Module, ep_mesh: DeviceMesh) -> int:
    """Split the routed experts of every ``MoE`` layer of ``model`` over ``ep_mesh``: each
    stacked expert weight becomes a DTensor sharded on its expert dimension (``Shard(0)``), and
    the layer exchanges its tokens with the other ranks of the mesh. Works on the meta device,
    before materialization. Returns how many layers it split.

    Raises:
        ValueError: if a layer's ``num_experts`` is not a multiple of the mesh size, or its
            experts are wrapped (peft's LoRA on them), naming the layer.
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
        if not isinstance(layer.experts, GroupedExperts):
            # peft's target_parameters wraps them (ParamWrapper): their weights move out of
            # reach and its adapter spans every expert, so the split would be silently wrong.
            raise ValueError(
                f"MoE layer {name!r} holds its experts in a {type(layer.experts).__name__} "
                "(peft's target_parameters puts LoRA on them so): expert parallelism splits "
                "GroupedExperts' stacked weights only; leave the experts out of the LoRA "
                "config (adapt the attention projections), or set expert_parallel=1")
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


class Experts:
    """Without expert parallelism every rank holds every expert: nothing to split or shard.

    A part of every layout, since expert parallelism composes with the other degrees (it
    borrows its ranks from ``dp_shard`` x ``cp``); ``ExpertParallel`` is the one that acts.
    """

    def found_anywhere(self, here: bool) -> bool:
        """Whether the run's models hold ``MoE`` layers anywhere, given whether the model
        ``apply_expert_parallel`` was just called on does: here, that model's answer."""
        return here

    def fully_shard(self, models: Iterable[nn.Module], config: dict[str, Any]) -> None:
        """Shard the experts with FSDP2 before the blocks holding them are sharded."""


class ExpertParallel(Experts):
    """``expert_parallel > 1``: experts split over the ``ep`` axis (within a pipeline stage,
    apart from tensor-parallel ranks, which route the same tokens alike), then sharded by
    FSDP2 over the ranks left (``efsdp``, replicated over ``dp_replicate`` for HSDP)."""

    def __init__(self, world: DistributedWorld) -> None:
        self.world = world
        self._stages_seen: list[bool] = []

    def found_anywhere(self, here: bool) -> bool:
        """Under a pipeline ``apply_expert_parallel`` runs once per stage, and a stage without
        ``MoE`` layers is fine when another has some: the ``i``-th call of every pipeline
        rank meets the others' ``i``-th in one collective (each rank holds as many stages),
        and the verdict falls at this rank's last stage, the same on every rank (True
        before it)."""
        if self.world.dims.pp == 1:
            return here
        pp_mesh = self.world.launched_mesh(MeshAxis.PP)
        self._stages_seen.append(agree_any(here, self.world.device, pp_mesh.get_group()))
        if len(self._stages_seen) < self.world.dims.pp_stages_per_rank:
            return True
        seen, self._stages_seen = self._stages_seen, []
        return any(seen)

    def fully_shard(self, models: Iterable[nn.Module], config: dict[str, Any]) -> None:
        mesh = self.world.expert_fsdp_mesh
        if mesh is None:
            raise RuntimeError("the efsdp mesh axis does not exist: the run is not launched")
        for model in models:
            fully_shard_experts(model, mesh, config)
