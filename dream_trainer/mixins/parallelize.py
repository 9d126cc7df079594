"""How ``SetupMixin`` parallelizes the models: float8 conversion, the overridable hooks
(pipeline split, tensor parallelism, activation checkpointing, compilation, FSDP2, DDP) and
the order they run in."""

from __future__ import annotations

import copy
import logging
from abc import abstractmethod
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from dream_trainer.parallel.blocks import find_blocks
from dream_trainer.parallel.data_parallel import DDPBackend
from dream_trainer.parallel.experts import distribute_experts, fully_shard_experts
from dream_trainer.parallel.float8 import convert_to_float8
from dream_trainer.parallel.materialize import (FullTensorInit, has_meta_tensors, materialize,
                                                parameters_named)
from dream_trainer.parallel.hf_init import is_hf_model
from dream_trainer.parallel.hf_pipeline import split_pipeline
from dream_trainer.parallel.pipeline import PipelineStages, stage_ids, tied_names
from dream_trainer.parallel.pipeline_schedule import PipelineRunner
from dream_trainer.parallel.stage_init import copy_into_stages, materialize_stages
from dream_trainer.trainer.abstract import AbstractTrainer
from dream_trainer.world.dims import MeshAxis

if TYPE_CHECKING:
    from dream_trainer.checkpoint.pretrained import PretrainedWeights

logger = logging.getLogger(__name__)


class ParallelizeModels(AbstractTrainer):
    """The parallelism half of ``SetupMixin``: its hooks, which a trainer overrides for its
    own models, and the order ``build_training()`` applies them in."""

    @abstractmethod
    def _init_weights(self, loaded: list[torch.Tensor] | None = None,
                      pretrained: PretrainedWeights | None = None,
                      run_init_weights: bool = True) -> None:
        """Run ``init_weights()``, check every tensor is initialized, load ``pretrained``
        (``SetupMixin``)."""

    @abstractmethod
    def _pretrained_weights(self) -> PretrainedWeights | None:
        """The planned ``init_weights_from`` load, if any (``SetupMixin``)."""

    @abstractmethod
    def init_weights(self) -> None:
        """The user's initialization after materialization (``SetupMixin``)."""

    @abstractmethod
    def _has_own_init_weights(self) -> bool:
        """True when the trainer overrides ``init_weights()`` (``SetupMixin``)."""

    # -- hooks ---------------------------------------------------------------------------------
    def apply_pipeline_parallel(self, pp_mesh: DeviceMesh) -> list[nn.Module]:
        """Split the model into pipeline stages; return this rank's, one per ``stage_ids``.

        The default is ``split_model(model, stage_ids(...), num_stages)``: the
        blocks ``find_blocks`` finds are split evenly, modules before them go to the first
        stage and after them to the last, and everything of other stages is set to None,
        so the model's ``forward`` must skip None modules. A ``transformers`` decoder (Llama,
        Qwen2/3, Mistral, any causal LM with ``model.layers``) is split by
        ``split_hf_decoder`` instead, which needs no such convention. Override it for a model
        that follows neither; return modules whose parameter names are the model's.

        Args:
            pp_mesh: The pipeline mesh.

        Returns:
            One module per stage in ``stage_ids(pp_mesh.get_local_rank(), pp_mesh.size(),
            device_parameters)``, in that order.
        """
        ids = stage_ids(pp_mesh.get_local_rank(), pp_mesh.size(), self.config.device_parameters)
        return split_pipeline(getattr(self, _pipelined_model(self)), ids,
                              self.world.dims.pp_stages)

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
        weight over all of them. Override it for a mixture-of-experts module of your own:
        shard its expert weights over ``ep_mesh`` and dispatch its tokens there.

        Raises:
            ValueError: if a layer's ``num_experts`` is not a multiple of ``ep_mesh``'s size,
                or no model has an ``MoE`` layer (nothing would use the degree).
        """
        split = sum(distribute_experts(model, ep_mesh) for model in self.named_models().values())
        if not split:
            raise ValueError(f"expert_parallel={ep_mesh.size()} but no model has a "
                             "dream_trainer.nn.MoE layer: set expert_parallel=1, or override "
                             f"{type(self).__name__}.apply_expert_parallel(ep_mesh) for your "
                             "own mixture-of-experts module")

    def apply_activation_checkpointing(self) -> None:
        """Recompute each block's activations in backward (see ``find_blocks``).

        Override to checkpoint a different set of modules.
        """
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
            checkpoint_wrapper)

        for model in self.named_models().values():
            for container, name, block in find_blocks(model):
                setattr(container, name, checkpoint_wrapper(block))

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

        Args:
            config: Keyword arguments for ``fully_shard``: the mesh, the
                ``MixedPrecisionPolicy`` and the offload policy built from
                ``DeviceParameters``. Pass them on when overriding.
        """
        from torch.distributed.fsdp import fully_shard

        for model in self.named_models().values():
            if not any(p.requires_grad for p in model.parameters()):
                continue
            for _, _, block in find_blocks(model):
                fully_shard(block, **config)
            fully_shard(model, **config)

    def apply_replicate(self, mesh: DeviceMesh) -> None:
        """Replicate every model with trainable parameters over ``mesh`` with DDP."""
        backend = DDPBackend()
        for name, model in self.named_models().items():
            if any(p.requires_grad for p in model.parameters()):
                setattr(self, name, backend.wrap(model, mesh, self.world.device))

    # -- applying them -------------------------------------------------------------------------
    def _apply_parallelism(self) -> None:
        params = self.config.device_parameters
        dims = self.world.dims
        if params.float8_recipe is not None:
            self._convert_float8()
        if dims.tp > 1:
            tp_mesh = self.world.get_mesh(MeshAxis.TP)
            assert tp_mesh is not None
            self.apply_tensor_parallel(tp_mesh)
        if dims.ep > 1:
            ep_mesh = self.world.get_mesh(MeshAxis.EP)
            assert ep_mesh is not None
            self.apply_expert_parallel(ep_mesh)
        if params.checkpoint_activations:
            self.apply_activation_checkpointing()
        if params.compile_model:
            self.apply_compile()
        if dims.dp_shard > 1:
            config = self._fully_shard_config()
            if dims.ep > 1:
                efsdp_mesh = self.world.get_mesh(MeshAxis.EFSDP)
                assert efsdp_mesh is not None
                for model in self.named_models().values():
                    fully_shard_experts(model, efsdp_mesh, config)
            self.apply_fully_shard(config)

    def _convert_float8(self) -> None:
        """Swap every model's eligible Linear layers for torchao's ``Float8Linear`` (on the
        meta device, before any other parallelism, which then shards the float8 modules)."""
        params, dims = self.config.device_parameters, self.world.dims
        # torchao all-gathers float8 weights with tensorwise scales only.
        all_gather = params.float8_recipe == "tensorwise" and dims.dp_shard > 1
        for name, model in self.named_models().items():
            converted = convert_to_float8(model, params.float8_recipe, params.float8_filter,
                                          self.world.device, all_gather)
            logger.info("%s: %d Linear layers train in float8 (%s)", name, len(converted),
                        params.float8_recipe)

    def _setup_pipeline(self) -> None:
        """Split, parallelize each stage, materialize this rank's stages, wrap them.

        DDP replicas of stages were refused when the degrees were resolved
        (``ParallelDims.resolve``)."""
        name = _pipelined_model(self)
        model = getattr(self, name)
        pretrained = self._pretrained_weights()
        reference = copy.deepcopy(model) if has_meta_tensors(model) else None
        ties = tied_names(model)  # of the whole model: the split leaves a copy per stage
        pp_mesh = self.world.get_mesh(MeshAxis.PP)
        assert pp_mesh is not None
        params, dims = self.config.device_parameters, self.world.dims
        ids = stage_ids(pp_mesh.get_local_rank(), pp_mesh.size(), params)
        stages = self.apply_pipeline_parallel(pp_mesh)
        if len(stages) != len(ids):
            raise ValueError(f"apply_pipeline_parallel returned {len(stages)} stages; this rank "
                             f"holds {len(ids)} (stages {ids})")
        stages = [self._on_stage(name, stage, self._apply_parallelism) for stage in stages]
        self.world.seed(self.config.seed)
        materialization = self.world.materialization
        skip = pretrained.names(name) if pretrained is not None else set()
        # A stage's copy of a tied weight is loaded under whichever name the files hold.
        skip |= {tied for group in ties if skip & set(group) for tied in group}
        whole = reference is not None and materialization.has_values \
            and self._initializes_whole_model(reference)
        with materialization.context():
            if reference is None:
                for stage in stages:
                    stage.to(self.world.device)
            elif not materialization.has_values:  # no one-process values to reproduce
                for stage in stages:
                    materialize(stage, self.world.device, values=False)
            elif whole:
                self._initialize_whole_model(name, reference, stages, skip)
            else:
                materialize_stages(reference, stages, self.world.device, skip)
        runner = PipelineRunner(params.pipeline_schedule, dims.pp_microbatches, ids,
                                dims.pp_stages, dims.pp, self._pp_group, self.world.device)
        container = PipelineStages(stages, ids, dims.pp_stages, runner, ties)
        if ties and materialization.has_values:
            container.connect_ties(pp_mesh.get_group())
        setattr(self, name, container)
        if pretrained is not None:
            pretrained.use_models(self.named_models())
        loaded = parameters_named(container, skip)
        with materialization.context():
            self._init_weights(loaded, pretrained, run_init_weights=not whole)

    def _initializes_whole_model(self, reference: nn.Module) -> bool:
        """Whether a pipeline's weights come from initializing the whole model on every rank
        rather than block by block: needed when ``init_weights()`` is the user's (it may draw
        from the generator anywhere in the model), for a ``transformers`` model (its library
        initialization and computed buffers run over the whole model) and for a model with
        tied parameters (the last initializer of a shared weight sets both places)."""
        return self._has_own_init_weights() or any(map(is_hf_model, reference.modules())) \
            or bool(tied_names(reference))

    def _initialize_whole_model(self, name: str, reference: nn.Module,
                                stages: list[nn.Module], skip: set[str]) -> None:
        """Initialize ``reference`` (the whole model) exactly as one process would, with
        ``init_weights()`` seeing it as the model attribute, and give ``stages`` their part.

        Every rank holds the whole unsharded model for the duration; parameters the
        pretrained weights will set (``skip``) are allocated but not drawn.
        """
        device = self.world.device
        materialize(reference, device, skip=skip)
        pipelined = getattr(self, name)
        setattr(self, name, reference)
        try:
            # As in one process, draws for the pretrained parameters are skipped, not made.
            with FullTensorInit(skip=parameters_named(reference, skip)):
                self.init_weights()
        finally:
            setattr(self, name, pipelined)
        for stage in stages:
            stage.to_empty(device=device)
        copy_into_stages(reference, stages)

    def _pp_group(self) -> Any:
        mesh = self.world.get_mesh(MeshAxis.PP)
        if mesh is None:
            raise RuntimeError("the pipeline has no process group: the run is not launched")
        return mesh.get_group()

    def _on_stage(self, name: str, stage: nn.Module, hooks: Any) -> nn.Module:
        """Run ``hooks()`` with the model attribute bound to ``stage``; return what the hooks
        left there (a hook may replace the module, as compile and DDP do)."""
        setattr(self, name, stage)
        hooks()
        return getattr(self, name)  # type: ignore[no-any-return]

    def _fully_shard_config(self) -> dict[str, Any]:
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy

        params = self.config.device_parameters
        precision = MixedPrecisionPolicy(
            param_dtype=None if params.param_dtype == torch.float32 else params.param_dtype,
            reduce_dtype=params.reduce_dtype,
        )
        # Pinned memory needs an accelerator; on a CPU-only machine pinning fails.
        offload = CPUOffloadPolicy(pin_memory=self.world.device.type == "cuda") \
            if params.cpu_offload else OffloadPolicy()
        return {"mesh": self.world.fsdp_mesh, "mp_policy": precision, "offload_policy": offload}


def _pipelined_model(trainer: AbstractTrainer) -> str:
    """The attribute of the one model a pipeline splits.

    Raises:
        ValueError: if ``configure_models`` assigned several models.
    """
    names = list(trainer.named_models())
    if len(names) != 1:
        raise ValueError(
            f"pipeline_parallel > 1 splits one model into stages, but configure_models "
            f"assigned {len(names)}: {names}; train them in separate runs, or set "
            "pipeline_parallel=1"
        )
    return names[0]
