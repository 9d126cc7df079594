"""The overridable parallelism hooks of ``SetupMixin`` (pipeline split, tensor and expert
parallelism, activation checkpointing, compilation, FSDP2, DDP). The layout's parts call
them, in the order ``dream_trainer.parallel.parts.PARTS`` declares."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from dream_trainer.parallel.blocks import find_blocks
from dream_trainer.parallel.checkpointing import checkpoint_blocks
from dream_trainer.parallel.data_parallel import DDPBackend
from dream_trainer.parallel.experts import distribute_experts
from dream_trainer.parallel.hf_pipeline import split_pipeline
from dream_trainer.trainer.abstract import AbstractTrainer


class ParallelizeModels(AbstractTrainer):
    """The parallelism half of ``SetupMixin``: its hooks, which a trainer overrides for its
    own models; the layout's parts call them in their declared order (docs/concepts.md,
    "The build order")."""

    # -- hooks ---------------------------------------------------------------------------------
    def apply_pipeline_parallel(self, pp_mesh: DeviceMesh) -> list[nn.Module]:
        """Split the model into pipeline stages; return this rank's, one per ``stage_ids``.

        The default is ``split_model(model, self.layout.stage_ids, num_stages)``: the
        blocks ``find_blocks`` finds are split evenly, modules before them go to the first
        stage and after them to the last, and everything of other stages is set to None,
        so the model's ``forward`` must skip None modules. A ``transformers`` decoder (Llama,
        Qwen2/3, Mistral, any causal LM with ``model.layers``) is split by
        ``split_hf_decoder`` instead, which needs no such convention. Override it for a model
        that follows neither; return modules whose parameter names are the model's.

        Args:
            pp_mesh: The pipeline mesh.

        Returns:
            One module per stage in ``self.layout.stage_ids`` (``stage_ids(
            pp_mesh.get_local_rank(), self.world.dims)``), in that order.
        """
        # The layout refused several models before asking for the split: this is the one.
        (model,) = self.named_models().values()
        return split_pipeline(model, self.layout.stage_ids, self.world.dims.pp_stages)

    def apply_tensor_parallel(self, tp_mesh: DeviceMesh) -> None:
        """Parallelize the models over ``tp_mesh`` (``parallelize_module``).

        There is no sensible default for an arbitrary model, so a subclass that sets
        ``tensor_parallel > 1`` must override this.
        """
        raise NotImplementedError(
            f"tensor_parallel={tp_mesh.size()} needs a plan: override "
            f"{type(self).__name__}.apply_tensor_parallel(tp_mesh)"
        )

    def apply_expert_parallel(self, ep_mesh: DeviceMesh) -> None:
        """Split the routed experts of every ``dream_trainer.nn.MoE`` layer over ``ep_mesh``
        (``expert_parallel > 1``): each rank holds ``num_experts / ep`` experts, and the
        layers send every token to the rank of each expert it chose and back (all-to-all).

        Runs on the meta device, after tensor parallelism and before FSDP2, which then
        shards each rank's experts over the remaining data-parallel ranks and every other
        weight over all of them. Under a pipeline it runs once per stage: a stage without
        an ``MoE`` layer is fine when another stage has one (the pipeline ranks count them
        together, one small collective per stage at setup). Another codebase's MoE module
        becomes ``MoE`` layers with ``replace_hf_moe_blocks`` (transformers) or
        ``replace_torchtitan_moe_blocks`` (torchtitan); for one of your own, override this:
        shard its expert weights over ``ep_mesh`` and dispatch its tokens there.

        Raises:
            ValueError: if a layer's ``num_experts`` is not a multiple of ``ep_mesh``'s size,
                or no model (no stage of the pipeline) has an ``MoE`` layer: nothing would
                use the degree. Every rank raises it.
        """
        split = sum(distribute_experts(model, ep_mesh) for model in self.named_models().values())
        if not self.layout.experts.found_anywhere(split > 0):
            raise ValueError(f"expert_parallel={ep_mesh.size()} but no model (no stage of a "
                             "pipeline) has a dream_trainer.nn.MoE layer: set "
                             "expert_parallel=1, convert your MoE modules to MoE layers "
                             "(replace_hf_moe_blocks, replace_torchtitan_moe_blocks), or "
                             f"override {type(self).__name__}.apply_expert_parallel(ep_mesh) "
                             "for your own mixture-of-experts module")

    def context_parallel_buffers(self) -> dict[str, int]:
        """The position buffers to cut with the sequence under ``context_parallel > 1``, as
        ``{"<model attribute>.<module path>.<buffer>": sequence_dim}``: tables indexed by
        position (a rotary ``freqs`` of ``[max_len, head_dim]`` is ``{"model.rope.freqs":
        0}``), which inside a step hold only this rank's positions, in its order, so that
        a model reading ``table[:seq_len]`` gets the rows of the positions it holds. Models
        that take positions as an input need none. The default names none.
        """
        return {}

    def apply_activation_checkpointing(self) -> None:
        """Wrap the blocks of every model (see ``find_blocks``) for recomputation in backward
        as ``self.config.device_parameters.activation_checkpointing`` says: every block for
        ``"full"``, ``"selective"`` and a policy function (the last two op by op), blocks 0,
        N, 2N, ... for an int N. Runs only when a policy is set.

        Override to checkpoint a different set of modules; read the policy from the same
        field (an override that ignores it checkpoints as it likes).
        """
        policy = self.config.device_parameters.activation_checkpointing
        for model in self.named_models().values():
            checkpoint_blocks(model, policy)

    def apply_compile(self) -> None:
        """Compile each block with ``torch.compile`` (each whole model if it has none).

        ``nn.Module.compile()`` silently leaves torch's built-in modules uncompiled, so blocks
        are replaced by ``torch.compile(block)``; checkpoints strip the wrapper's prefix.
        """
        for name, model in self.named_models().items():
            blocks = find_blocks(model)
            if not blocks:
                setattr(self, name, torch.compile(model))
            for container, block_name, block in blocks:
                setattr(container, block_name, torch.compile(block))

    def apply_fully_shard(self, config: dict[str, Any]) -> None:
        """Shard each block of every model with FSDP2, then the model itself.

        A frozen model (no trainable parameter: a reference model) is sharded alike, its root
        resharded after forward too: no backward follows to use the gathered weights that
        FSDP2 otherwise keeps for it.

        Args:
            config: Keyword arguments for ``fully_shard``: the mesh, the
                ``MixedPrecisionPolicy`` and the offload policy built from
                ``DeviceParameters``. Pass them on when overriding.
        """
        from torch.distributed.fsdp import fully_shard

        for model in self.named_models().values():
            for _, _, block in find_blocks(model):
                fully_shard(block, **config)
            frozen = not any(p.requires_grad for p in model.parameters())
            fully_shard(model, **config, **({"reshard_after_forward": True} if frozen else {}))

    def apply_replicate(self, mesh: DeviceMesh) -> None:
        """Replicate every model with trainable parameters over ``mesh`` with DDP."""
        backend = DDPBackend()
        for name, model in self.named_models().items():
            if any(p.requires_grad for p in model.parameters()):
                setattr(self, name, backend.wrap(model, mesh, self.world.device))
