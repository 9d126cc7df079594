"""The layout strategy: what differs between one process (or data parallel), a pipeline and
expert parallelism, behind one interface that the loop and the mixins call without asking
which layout they are in.

``Layout.resolve`` picks it once per trainer from the resolved degrees (``world.dims``):
``Layout`` runs each model whole on every rank (one process, DDP, FSDP2, tensor
parallelism); ``PipelineLayout`` splits the one model into stages that the schedule runs.
Expert and context parallelism compose with either, so they are parts of the layout
(``Experts``, ``Context``) rather than kinds of it.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, Protocol

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from dream_trainer.configs.training import TrainingParameters, pipeline_batch_problem
from dream_trainer.data.loaders import pipeline_split_problem
from dream_trainer.parallel.context import Context, ContextParallel
from dream_trainer.parallel.data_parallel import DataParallelBackend
from dream_trainer.parallel.dtensor import full_value
from dream_trainer.parallel.experts import fully_shard_experts
from dream_trainer.parallel.grad_norm import clip_grad_norm
from dream_trainer.parallel.hf_init import is_hf_model
from dream_trainer.parallel.materialize import (FullTensorInit, has_meta_tensors, materialize,
                                                parameters_named)
from dream_trainer.parallel.pipeline import PipelineStages, stage_ids, tied_names
from dream_trainer.parallel.pipeline_schedule import LossFn, PipelineRunner
from dream_trainer.parallel.stage_init import copy_into_stages, materialize_stages
from dream_trainer.world.agree import agree_any
from dream_trainer.world.dims import MeshAxis
from dream_trainer.world.world import DistributedWorld


class ModelBuilder(Protocol):
    """What a layout builds the models through: the trainer's setup (``SetupMixin``), whose
    hooks the user overrides. ``build_models`` calls these in the layout's own order."""

    def named_models(self) -> dict[str, nn.Module]: ...

    def apply_pipeline_parallel(self, pp_mesh: DeviceMesh) -> list[nn.Module]: ...

    def apply_replicate(self, mesh: DeviceMesh) -> None: ...

    def init_weights(self) -> None: ...

    def _apply_parallelism(self) -> None:
        """Float8, tensor and expert parallelism, activation checkpointing, compilation and
        FSDP2 on the models ``named_models`` holds now, in that order."""

    def _materialize_models(self) -> None:
        """Give every model storage and its initial (or pretrained) values."""

    def _pretrained_weights(self) -> Any:
        """The planned ``init_weights_from`` load (a ``PretrainedWeights``), if any."""

    def _has_own_init_weights(self) -> bool: ...

    def _init_weights(self, loaded: list[torch.Tensor] | None = None, pretrained: Any = None,
                      run_init_weights: bool = True) -> None:
        """``init_weights()``, the check that every tensor is set, the pretrained load."""

    def _reseed(self) -> None:
        """Seed every generator from the config's seed, so weights depend on it alone."""

    def _bind_model(self, name: str, module: nn.Module) -> nn.Module:
        """Make the model attribute ``name`` hold ``module``; return what it held."""


class Experts:
    """Without expert parallelism every rank holds every expert: nothing to split or shard.

    A part of every layout, since expert parallelism composes with the other degrees (it
    borrows its ranks from ``dp_shard`` x ``cp``); ``ExpertParallel`` is the one that acts.
    """

    def split(self, apply_expert_parallel: Callable[[DeviceMesh], None]) -> None:
        """Split the routed experts over the ``ep`` ranks with ``apply_expert_parallel``."""

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

    def split(self, apply_expert_parallel: Callable[[DeviceMesh], None]) -> None:
        apply_expert_parallel(_mesh(self.world, MeshAxis.EP))

    def found_anywhere(self, here: bool) -> bool:
        """Under a pipeline ``apply_expert_parallel`` runs once per stage, and a stage without
        ``MoE`` layers is fine when another has some: the ``i``-th call of every pipeline
        rank meets the others' ``i``-th in one collective (each rank holds as many stages),
        and the verdict falls at this rank's last stage, the same on every rank (True
        before it)."""
        if self.world.dims.pp == 1:
            return here
        pp_mesh = _mesh(self.world, MeshAxis.PP)
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


class Layout:
    """One process or data parallel: every rank runs each model whole (replicated by DDP,
    sharded by FSDP2, or split by tensor parallelism inside its modules).

    Args:
        world: The run's topology; its meshes are read when needed (they exist after launch).
        data_parallel: How the models are replicated (``backend_for(world.dims)``).
    """

    def __init__(self, world: DistributedWorld, data_parallel: DataParallelBackend) -> None:
        self.world = world
        self.data_parallel = data_parallel
        self.experts: Experts = ExpertParallel(world) if world.dims.ep > 1 else Experts()
        params = world.device_parameters
        self.context: Context = ContextParallel(
            world, params.context_parallel_seq_dim, params.context_parallel_load_balance) \
            if world.dims.cp > 1 else Context()

    @staticmethod
    def resolve(world: DistributedWorld, data_parallel: DataParallelBackend) -> Layout:
        """The layout of ``world.dims``, once per trainer: a ``PipelineLayout`` when
        ``pp > 1``, else a ``Layout``."""
        kind = PipelineLayout if world.dims.pp > 1 else Layout
        return kind(world, data_parallel)

    # -- models ----------------------------------------------------------------------------
    @property
    def stage_ids(self) -> list[int]:
        """The pipeline stages this rank holds: the one stage, the whole model."""
        return [0]

    def build_models(self, builder: ModelBuilder) -> None:
        """Parallelize, materialize and wrap the models ``configure_models`` created on the
        meta device (``SetupMixin``'s setup steps 1-7)."""
        builder._apply_parallelism()
        with self.world.materialization.context():
            builder._materialize_models()
        dims = self.world.dims
        # DDP needs real tensors: it broadcasts rank 0's weights when it wraps the model.
        if dims.dp_replicate > 1 and dims.fsdp == 1:
            builder.apply_replicate(_mesh(self.world, MeshAxis.DP_REPLICATE))

    def check_batches(self, params: TrainingParameters,
                      val_loaders: Mapping[str, Iterable[Any]]) -> None:
        """Refuse at setup the batches the layout could not run (``val_loaders`` by how an
        error names them); any batch runs whole."""

    # -- a micro-batch ---------------------------------------------------------------------
    def check_backward(self) -> None:
        """Refuse ``backward()`` where the layout runs backward itself; it may run here."""

    def forward_backward(self, model: nn.Module, inputs: tuple[Any, ...], target: Any,
                         loss_fn: LossFn, backward: Callable[[torch.Tensor], None],
                         loss_scale: Callable[[], float], sum_losses: bool) -> torch.Tensor:
        """Run ``loss_fn(model(*inputs), target)`` forward and backward; return the loss,
        detached, the same on every rank (see ``StepAPI.forward_backward``).

        Args:
            backward: Backpropagates a loss as ``StepAPI.backward`` does (counting items).
            loss_scale: Counts the micro-batch's items and returns the factor its loss is
                multiplied by, for a layout that backpropagates itself.
            sum_losses: Whether ``loss_fn`` returns a sum (``num_items`` was given).
        """
        with self.context.split((*inputs, target)) as (*inputs, target):
            loss = loss_fn(model(*inputs), target)
            backward(loss)
        # A DTensor under loss_parallel; this rank's part of the sequences under cp.
        return self.context.whole_loss(full_value(loss.detach()), sum_losses)

    def forward_loss(self, model: nn.Module, inputs: tuple[Any, ...], target: Any,
                     loss_fn: LossFn, sum_losses: bool) -> torch.Tensor:
        """``forward_backward`` without the backward (``StepAPI.forward_loss``)."""
        with self.context.split((*inputs, target)) as (*inputs, target):
            loss = full_value(loss_fn(model(*inputs), target).detach())
        return self.context.whole_loss(loss, sum_losses)

    def local_pass(self, models: Iterable[nn.Module]) -> contextlib.AbstractContextManager[None]:
        """A context in which the models' forward and backward run on this rank alone, for a
        diagnostic re-run (``rerun_training_step``).

        Raises:
            RuntimeError: where a pass needs the other ranks (FSDP2, a pipeline).
        """
        return _local_passes(self.data_parallel, list(models))

    # -- gradients -------------------------------------------------------------------------
    def register_steps(self, points: Any) -> None:
        """Add this layout's actions to the optimizer step (``StepPoints``): none here, so a
        layout that leaves no gradient partial costs the step nothing."""

    def reduce_gradients(self, model: nn.Module) -> None:
        """Complete the gradients the layout leaves partial, before they are measured and
        applied (the step's ``after_backward`` point); none here."""

    def clip_grad_norm(self, model: nn.Module, max_norm: float | None) -> torch.Tensor:
        """The total gradient norm of ``model`` (each parameter counted once, over every
        rank that holds a part of it), clipped to ``max_norm`` when given; no host sync."""
        return clip_grad_norm(model.parameters(), max_norm)

    # -- validation ------------------------------------------------------------------------
    def agree_to_compute(self, updated: bool) -> bool:
        """Whether this rank computes a metric that ``updated`` says it fed: every rank that
        syncs its states takes part, so they decide together (a collective)."""
        return agree_any(updated, self.world.device)

    def share_results(self, values: dict[str, float]) -> dict[str, float]:
        """``values`` as the ranks that see the models' outputs computed them, on every rank
        (a collective where only some see them)."""
        return values

    # -- teardown --------------------------------------------------------------------------
    def teardown(self) -> bool:
        """Release what the layout holds of the process group before it is destroyed; return
        whether there was anything (the caller then collects garbage)."""
        return False


class PipelineLayout(Layout):
    """``pipeline_parallel > 1``: the one model is split into stages over the ``pp`` ranks,
    the model attribute holds this rank's ``PipelineStages``, and the schedule runs each
    micro-batch forward and backward stage by stage."""

    def __init__(self, world: DistributedWorld, data_parallel: DataParallelBackend) -> None:
        super().__init__(world, data_parallel)
        self.stages: PipelineStages | None = None
        """This rank's stages, once ``build_models`` made them."""

    # -- models ----------------------------------------------------------------------------
    @property
    def stage_ids(self) -> list[int]:
        """The pipeline stages this rank holds (``stage_ids``), after launch."""
        return stage_ids(_mesh(self.world, MeshAxis.PP).get_local_rank(), self.world.dims)

    def build_models(self, builder: ModelBuilder) -> None:
        """Split the model (``apply_pipeline_parallel``), run the other parallelism hooks on
        each of this rank's stages with the model attribute bound to it, materialize the
        stages with the weights one process would have, and make the model attribute their
        ``PipelineStages``.

        DDP replicas of stages were refused when the degrees were resolved
        (``ParallelDims.resolve``).

        Raises:
            ValueError: if several models were configured, or the hook returned another
                number of stages than this rank holds.
        """
        world, dims = self.world, self.world.dims
        name = pipelined_model(builder.named_models())
        model = builder.named_models()[name]
        pretrained = builder._pretrained_weights()
        reference = copy.deepcopy(model) if has_meta_tensors(model) else None
        ties = tied_names(model)  # of the whole model: the split leaves a copy per stage
        ids = self.stage_ids
        stages = builder.apply_pipeline_parallel(_mesh(world, MeshAxis.PP))
        if len(stages) != len(ids):
            raise ValueError(f"apply_pipeline_parallel returned {len(stages)} stages; this rank "
                             f"holds {len(ids)} (stages {ids})")
        stages = [_parallelized(builder, name, stage) for stage in stages]
        builder._reseed()
        materialization = world.materialization
        skip = pretrained.names(name) if pretrained is not None else set()
        # A stage's copy of a tied weight is loaded under whichever name the files hold.
        skip |= {tied for group in ties if skip & set(group) for tied in group}
        whole = reference is not None and materialization.has_values \
            and _initializes_whole_model(builder, reference)
        with materialization.context():
            if reference is None:
                for stage in stages:
                    stage.to(world.device)
            elif not materialization.has_values:  # no one-process values to reproduce
                for stage in stages:
                    materialize(stage, world.device, values=False)
            elif whole:
                self._initialize_whole_model(builder, name, reference, stages, skip)
            else:
                materialize_stages(reference, stages, world.device, skip)
        runner = PipelineRunner(dims.pp_schedule, dims.pp_microbatches, ids, dims.pp_stages,
                                dims.pp, self._pp_group, world.device)
        self.stages = PipelineStages(stages, ids, dims.pp_stages, runner, ties)
        if ties and materialization.has_values:
            self.stages.connect_ties(self._pp_group())
        builder._bind_model(name, self.stages)
        if pretrained is not None:
            pretrained.use_models(builder.named_models())
        loaded = parameters_named(self.stages, skip)
        with materialization.context():
            builder._init_weights(loaded, pretrained, run_init_weights=not whole)

    def _initialize_whole_model(self, builder: ModelBuilder, name: str, reference: nn.Module,
                                stages: list[nn.Module], skip: set[str]) -> None:
        """Initialize ``reference`` (the whole model) exactly as one process would, with
        ``init_weights()`` seeing it as the model attribute, and give ``stages`` their part.

        Every rank holds the whole unsharded model for the duration; parameters the
        pretrained weights will set (``skip``) are allocated but not drawn.
        """
        device = self.world.device
        materialize(reference, device, skip=skip)
        pipelined = builder._bind_model(name, reference)
        try:
            # As in one process, draws for the pretrained parameters are skipped, not made.
            with FullTensorInit(skip=parameters_named(reference, skip)):
                builder.init_weights()
        finally:
            builder._bind_model(name, pipelined)
        for stage in stages:
            stage.to_empty(device=device)
        copy_into_stages(reference, stages)

    def check_batches(self, params: TrainingParameters,
                      val_loaders: Mapping[str, Iterable[Any]]) -> None:
        """Refuse a batch the schedule could not cut into its microbatches: a configured
        batch size (the config could not check it when ``pipeline_parallel`` was
        ``"auto"``) and each validation loader's batches, short ones included, where its
        length tells them.

        Raises:
            ValueError: naming the batch size or the loader, and the fix.
        """
        microbatches = self.world.dims.pp_microbatches
        problems = [pipeline_batch_problem(params, microbatches)] + [
            pipeline_split_problem(loader, kind, microbatches, params.val_steps_per_epoch)
            for kind, loader in val_loaders.items()]
        problem = next((problem for problem in problems if problem is not None), None)
        if problem is not None:
            raise ValueError(problem)

    # -- a micro-batch ---------------------------------------------------------------------
    def check_backward(self) -> None:
        raise RuntimeError(
            "backward() cannot run under pipeline_parallel > 1: the pipeline schedule runs "
            "forward and backward stage by stage. Replace `loss = loss_fn(self.model(x), "
            "y); self.backward(loss)` with `loss = self.forward_backward(self.model, x, "
            "target=y, loss_fn=loss_fn)`, which does the same without a pipeline"
        )

    def forward_backward(self, model: nn.Module, inputs: tuple[Any, ...], target: Any,
                         loss_fn: LossFn, backward: Callable[[torch.Tensor], None],
                         loss_scale: Callable[[], float], sum_losses: bool) -> torch.Tensor:
        """Run the micro-batch through the schedule: the inputs feed the first stage and the
        target the last, each split into ``pipeline_microbatches``; the loss is the mean of
        the microbatch losses (their sum with ``sum_losses``), on every rank."""
        with self.context.split((*inputs, target)) as (*inputs, target):
            loss = _held(model).run(tuple(inputs), target, loss_fn, loss_scale(), sum_losses)
        return self.context.whole_loss(loss, sum_losses)

    def forward_loss(self, model: nn.Module, inputs: tuple[Any, ...], target: Any,
                     loss_fn: LossFn, sum_losses: bool) -> torch.Tensor:
        with self.context.split((*inputs, target)) as (*inputs, target):
            loss = _held(model).run(tuple(inputs), target, loss_fn, None, sum_losses)
        return self.context.whole_loss(loss, sum_losses)

    def local_pass(self, models: Iterable[nn.Module]) -> contextlib.AbstractContextManager[None]:
        raise RuntimeError("a pass cannot run on one rank alone under pipeline_parallel > 1: "
                           "the schedule's passes are collective")

    # -- gradients -------------------------------------------------------------------------
    def register_steps(self, points: Any) -> None:
        """Sum tied weights' gradients at the step's ``after_backward`` point."""
        points.add("after_backward", "tied_weights",
                   lambda model, optimizer: self.reduce_gradients(model))

    def reduce_gradients(self, model: nn.Module) -> None:
        """Sum the gradients of each weight tied across stages into every copy
        (``PipelineStages.reduce_tied_gradients``)."""
        _held(model).reduce_tied_gradients()

    def clip_grad_norm(self, model: nn.Module, max_norm: float | None) -> torch.Tensor:
        """The norm of the whole model: every stage adds its squares over the pipeline
        group, and a weight tied across stages counts once."""
        return clip_grad_norm(model.parameters(), max_norm, pipeline_group=self._pp_group(),
                              uncounted=_held(model).uncounted_parameters)

    # -- validation ------------------------------------------------------------------------
    def agree_to_compute(self, updated: bool) -> bool:
        """Only the last stage sees outputs: its data-parallel ranks, which sync its
        metrics, decide among themselves."""
        dp_group = self.world.dp_group
        if dp_group is not None:
            updated = agree_any(updated, self.world.device, dp_group)
        return self.world.dims.pp_stages - 1 in self.stage_ids and updated

    def share_results(self, values: dict[str, float]) -> dict[str, float]:
        """The last stage's values, broadcast to every stage."""
        runner = self._built().runner
        assert runner is not None  # the stages built here have one
        return runner.from_last_stage(values)

    # -- teardown --------------------------------------------------------------------------
    def teardown(self) -> bool:
        """Drop the schedules (their stages hold process groups), so none outlives ``fit()``."""
        if self.stages is None:
            return False
        self.stages.teardown()
        return True

    def _pp_group(self) -> Any:
        return _mesh(self.world, MeshAxis.PP).get_group()

    def _built(self) -> PipelineStages:
        if self.stages is None:
            raise RuntimeError("the pipeline's stages exist only after the setup phase")
        return self.stages


def pipelined_model(models: Mapping[str, nn.Module]) -> str:
    """The attribute of the one model a pipeline splits.

    Raises:
        ValueError: if ``configure_models`` assigned several models.
    """
    names = list(models)
    if len(names) != 1:
        raise ValueError(
            f"pipeline_parallel > 1 splits one model into stages, but configure_models "
            f"assigned {len(names)}: {names}; train them in separate runs, or set "
            "pipeline_parallel=1"
        )
    return names[0]


def _parallelized(builder: ModelBuilder, name: str, stage: nn.Module) -> nn.Module:
    """Run the parallelism hooks with the model attribute bound to ``stage``; return what
    they left there (a hook may replace the module, as compilation does)."""
    previous = builder._bind_model(name, stage)
    builder._apply_parallelism()
    return builder._bind_model(name, previous)


def _initializes_whole_model(builder: ModelBuilder, reference: nn.Module) -> bool:
    """Whether a pipeline's weights come from initializing the whole model on every rank
    rather than block by block: needed when ``init_weights()`` is the user's (it may draw
    from the generator anywhere in the model), for a ``transformers`` model (its library
    initialization and computed buffers run over the whole model) and for a model with
    tied parameters (the last initializer of a shared weight sets both places)."""
    return builder._has_own_init_weights() or any(map(is_hf_model, reference.modules())) \
        or bool(tied_names(reference))


def _held(model: nn.Module) -> PipelineStages:
    if not isinstance(model, PipelineStages):
        raise TypeError(
            f"under pipeline_parallel > 1 the pipelined model runs through its stages: pass "
            f"the model attribute itself (a PipelineStages after setup), not a "
            f"{type(model).__name__}")
    return model


def _mesh(world: DistributedWorld, axis: MeshAxis) -> DeviceMesh:
    mesh = world.get_mesh(axis)
    if mesh is None:
        raise RuntimeError(f"the {axis} mesh axis does not exist: the run is not launched")
    return mesh


@contextlib.contextmanager
def _local_passes(data_parallel: DataParallelBackend,
                  models: list[nn.Module]) -> Iterator[None]:
    with contextlib.ExitStack() as passes:
        for model in models:
            passes.enter_context(data_parallel.local_pass(model))
        yield
