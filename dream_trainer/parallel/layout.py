"""The layout strategy: what differs between running each model whole and a pipeline, behind
one interface that the loop and the mixins call without asking which layout they are in.

``Layout.resolve`` picks it once per trainer from the resolved degrees (``world.dims``):
``Layout`` runs each model whole on every rank (one process, DDP, FSDP2, tensor
parallelism); ``PipelineLayout`` splits the one model into stages that the schedule runs.
Both build the models by running the parts (``parallel/parts.py``) in their declared order
(``PARTS``), a pipeline once per stage. Expert and context parallelism compose with either,
so what they keep for the step lives here too (``Experts``, ``Context``).
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from dream_trainer.configs.device import DeviceParameters
from dream_trainer.configs.training import TrainingParameters, pipeline_batch_problem
from dream_trainer.data.loaders import pipeline_split_problem
from dream_trainer.parallel.context import Context, ContextParallel
from dream_trainer.parallel.data_parallel import DataParallelBackend
from dream_trainer.parallel.documents import microbatch_documents
from dream_trainer.parallel.dtensor import full_value
from dream_trainer.parallel.experts import ExpertParallel, Experts
from dream_trainer.parallel.grad_norm import clip_grad_norm
from dream_trainer.parallel.hf_init import is_hf_model
from dream_trainer.parallel.build import ModelBuild, initialize, materialize_models
from dream_trainer.parallel.materialize import (FullTensorInit, has_meta_tensors, materialize,
                                                parameters_named)
from dream_trainer.parallel.parts import PARTS, BuildHooks, Part
from dream_trainer.parallel.pipeline import PipelineStages, stage_ids, tied_names
from dream_trainer.parallel.pipeline_schedule import (LossFn, PipelineRunner,
                                                     split_microbatches)
from dream_trainer.parallel.stage_init import copy_into_stages, materialize_stages
from dream_trainer.world.agree import agree_any
from dream_trainer.world.dims import MeshAxis
from dream_trainer.world.world import DistributedWorld


@dataclass(frozen=True)
class LayoutDescription:
    """What a layout is, for reports (``Layout.describe``)."""

    pipeline: dict[str, Any]
    """The pipeline's schedule, stages and microbatches by field; empty without one."""
    degrees: dict[str, int]
    """Every resolved degree by its config field (``ParallelDims.degrees``)."""
    parts: dict[str, str]
    """Each active part's description, in the build order."""
    settings: dict[str, Any]
    """The settings the active parts and the pipeline run with, by field name."""


class Layout:
    """One process or data parallel: every rank runs each model whole (replicated by DDP,
    sharded by FSDP2, or split by tensor parallelism inside its modules).

    Args:
        world: The run's topology; its meshes are read when needed (they exist after launch).
        data_parallel: How the models are replicated (``backend_for(world.dims)``).
        parts: The parts the build runs, in order (``PARTS``).
    """

    flat_optimizers = False
    """Whether checkpoints hold optimizer states keyed by parameter name, not index (a
    pipeline's stages number their parameters apart)."""

    def __init__(self, world: DistributedWorld, data_parallel: DataParallelBackend,
                 parts: tuple[Part, ...] = PARTS) -> None:
        self.world = world
        self.data_parallel = data_parallel
        self.parts = parts
        self.experts: Experts = ExpertParallel(world) if world.dims.ep > 1 else Experts()
        params = world.device_parameters
        self.context: Context = ContextParallel(
            world, params.context_parallel_seq_dim, params.context_parallel_load_balance) \
            if world.dims.cp > 1 else Context()

    @staticmethod
    def resolve(world: DistributedWorld, data_parallel: DataParallelBackend,
                parts: tuple[Part, ...] = PARTS) -> Layout:
        """The layout of ``world.dims``, once per trainer: a ``PipelineLayout`` when
        ``pp > 1``, else a ``Layout``, running ``parts`` in their order."""
        kind = PipelineLayout if world.dims.pp > 1 else Layout
        return kind(world, data_parallel, parts)

    # -- models ----------------------------------------------------------------------------
    @property
    def stage_ids(self) -> list[int]:
        """The pipeline stages this rank holds: the one stage, the whole model."""
        return [0]

    def active_parts(self, hooks: BuildHooks) -> list[Part]:
        """The parts this run uses (by the trainer's current settings), in order."""
        return self._active(hooks.config.device_parameters)

    def describe(self, params: DeviceParameters) -> LayoutDescription:
        """The one description of this layout that reports read (``TrainerSummary``,
        ``dream-trainer summarize``, ``NanGuard``): degrees, active parts, their settings.

        Args:
            params: The trainer's current device settings.
        """
        dims = self.world.dims
        active = self._active(params)
        settings = {key: value for part in active
                    for key, value in part.settings(params, dims).items()}
        return LayoutDescription(
            pipeline=self.pipeline_settings(), degrees=dims.degrees(),
            parts={part.name: part.describe(params, dims) for part in active},
            settings={**settings, **self.pipeline_settings()})

    def pipeline_settings(self) -> dict[str, Any]:
        """The pipeline's schedule, stages and microbatches by field name; none here."""
        return {}

    def _active(self, params: DeviceParameters) -> list[Part]:
        return [part for part in self.parts if part.active(params, self.world.dims)]

    def build_models(self, build: ModelBuild) -> None:
        """Parallelize, materialize and wrap the models ``configure_models`` created on the
        meta device: every active part on the meta models, storage and initial (or
        pretrained) values, then every active part on the built models."""
        self.parallelize(build.hooks)
        with self.world.materialization.context():
            materialize_models(build, self.world)
        self.finish(build.hooks)

    def parallelize(self, hooks: BuildHooks) -> None:
        """Run each active part's ``on_meta`` in order on the models the hooks hold now."""
        for part in self.active_parts(hooks):
            part.on_meta(hooks, self)

    def finish(self, hooks: BuildHooks) -> None:
        """Run each active part's ``after_materialize`` in order on the built models."""
        for part in self.active_parts(hooks):
            part.after_materialize(hooks, self)

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

    def documents(self, document_ids: torch.Tensor, position_ids: torch.Tensor | None,
                  models: Iterable[nn.Module]) -> contextlib.AbstractContextManager[None]:
        """Attention within packed documents (``StepAPI.documents``).

        Raises:
            ValueError: where the layout cannot keep the documents apart yet.
        """
        return self.context.documents(document_ids, position_ids, models)

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

    flat_optimizers = True

    def __init__(self, world: DistributedWorld, data_parallel: DataParallelBackend,
                 parts: tuple[Part, ...] = PARTS) -> None:
        super().__init__(world, data_parallel, parts)
        self.stages: PipelineStages | None = None
        """This rank's stages, once ``build_models`` made them."""

    def pipeline_settings(self) -> dict[str, Any]:
        dims = self.world.dims
        return {"pipeline_schedule": dims.pp_schedule, "pipeline_stages": dims.pp_stages,
                "pipeline_microbatches": dims.pp_microbatches}

    # -- models ----------------------------------------------------------------------------
    @property
    def stage_ids(self) -> list[int]:
        """The pipeline stages this rank holds (``stage_ids``), after launch."""
        return stage_ids(self.world.launched_mesh(MeshAxis.PP).get_local_rank(), self.world.dims)

    def build_models(self, build: ModelBuild) -> None:
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
        name = pipelined_model(build.models)
        model = build.models[name]
        pretrained = build.pretrained_weights()
        reference = copy.deepcopy(model) if has_meta_tensors(model) else None
        ties = tied_names(model)  # of the whole model: the split leaves a copy per stage
        ids = self.stage_ids
        stages = build.hooks.apply_pipeline_parallel(world.launched_mesh(MeshAxis.PP))
        if len(stages) != len(ids):
            raise ValueError(f"apply_pipeline_parallel returned {len(stages)} stages; this rank "
                             f"holds {len(ids)} (stages {ids})")
        stages = [self._parallelized(build, name, stage) for stage in stages]
        world.seed(build.seed)
        materialization = world.materialization
        skip = pretrained.names(name) if pretrained is not None else set()
        # A stage's copy of a tied weight is loaded under whichever name the files hold.
        skip |= {tied for group in ties if skip & set(group) for tied in group}
        whole = reference is not None and materialization.has_values \
            and _initializes_whole_model(build, reference)
        with materialization.context():
            if reference is None:
                for stage in stages:
                    stage.to(world.device)
            elif not materialization.has_values:  # no one-process values to reproduce
                for stage in stages:
                    materialize(stage, world.device, values=False)
            elif whole:
                self._initialize_whole_model(build, name, reference, stages, skip)
            else:
                materialize_stages(reference, stages, world.device, skip)
        runner = PipelineRunner(dims.pp_schedule, dims.pp_microbatches, ids, dims.pp_stages,
                                dims.pp, self._pp_group, world.device)
        self.stages = PipelineStages(stages, ids, dims.pp_stages, runner, ties)
        if ties and materialization.has_values:
            self.stages.connect_ties(self._pp_group())
        build.models[name] = self.stages
        if pretrained is not None:
            pretrained.use_models(dict(build.models))
        loaded = parameters_named(self.stages, skip)
        with materialization.context():
            initialize(build, world, loaded, pretrained, run_init_weights=not whole)
        self.finish(build.hooks)

    def _parallelized(self, build: ModelBuild, name: str, stage: nn.Module) -> nn.Module:
        """Run the parts on ``stage`` with the model attribute bound to it; return what they
        left there (a part may replace the module, as compilation does)."""
        with build.bound(name, stage) as bound:
            self.parallelize(build.hooks)
        return bound.module

    def _initialize_whole_model(self, build: ModelBuild, name: str, reference: nn.Module,
                                stages: list[nn.Module], skip: set[str]) -> None:
        """Initialize ``reference`` (the whole model) exactly as one process would, with
        ``init_weights()`` seeing it as the model attribute, and give ``stages`` their part.

        Every rank holds the whole unsharded model for the duration; parameters the
        pretrained weights will set (``skip``) are allocated but not drawn.
        """
        device = self.world.device
        materialize(reference, device, skip=skip)
        # As in one process, draws for the pretrained parameters are skipped, not made.
        with build.bound(name, reference), FullTensorInit(skip=parameters_named(reference, skip)):
            build.hooks.init_weights()
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

    @contextlib.contextmanager
    def documents(self, document_ids: torch.Tensor, position_ids: torch.Tensor | None,
                  models: Iterable[nn.Module]) -> Iterator[None]:
        """Packed documents through the schedule: every stage masks the microbatch it runs
        (forward, and backward where activations are recomputed) by that microbatch's rows
        of ``document_ids``, cut as the schedule cuts the inputs.

        Raises:
            ValueError: under context parallelism as well, which this does not combine with
                yet, or for ``document_ids`` that are not ``[batch, seq]``.
        """
        if isinstance(self.context, ContextParallel):
            raise ValueError(
                "packed documents (self.documents) do not run under pipeline_parallel > 1 "
                "with context_parallel > 1 yet: train them with one of the two, or pack "
                "without documents=True")
        if document_ids.dim() != 2:
            raise ValueError(f"document_ids of shape {tuple(document_ids.shape)}: give one "
                             "row of document ids per sequence, [batch, seq]")
        runner = self._built().runner
        assert runner is not None  # the stages built here have one
        chunks = split_microbatches(document_ids, self.world.dims.pp_microbatches)
        with microbatch_documents(chunks) as entering:
            runner.microbatch_hook = entering
            try:
                yield
            finally:
                runner.microbatch_hook = None

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
        return self.world.launched_mesh(MeshAxis.PP).get_group()

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
            f"assigned {len(names)}: {names}; train them in separate runs, set "
            "pipeline_parallel=1, or (a DPO reference) use a LoRA policy's base, adapters off")
    return names[0]


def _initializes_whole_model(build: ModelBuild, reference: nn.Module) -> bool:
    """Whether a pipeline's weights come from initializing the whole model on every rank
    rather than block by block: needed when ``init_weights()`` is the user's (it may draw
    from the generator anywhere in the model), for a ``transformers`` model (its library
    initialization and computed buffers run over the whole model) and for a model with
    tied parameters (the last initializer of a shared weight sets both places)."""
    return build.own_init_weights or any(map(is_hf_model, reference.modules())) \
        or bool(tied_names(reference))


def _held(model: nn.Module) -> PipelineStages:
    if not isinstance(model, PipelineStages):
        raise TypeError(
            f"under pipeline_parallel > 1 the pipelined model runs through its stages: pass "
            f"the model attribute itself (a PipelineStages after setup), not a "
            f"{type(model).__name__}")
    return model


@contextlib.contextmanager
def _local_passes(data_parallel: DataParallelBackend,
                  models: list[nn.Module]) -> Iterator[None]:
    with contextlib.ExitStack() as passes:
        for model in models:
            passes.enter_context(data_parallel.local_pass(model))
        yield
