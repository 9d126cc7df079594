"""``SetupMixin``: models on the meta device, parallelism, materialization, optimizers, data."""

from __future__ import annotations

import copy
import gc
import logging
from abc import abstractmethod
from collections.abc import Iterable, Mapping
from typing import Any, TypeVar

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.nn.parallel import DistributedDataParallel
from torch.optim.lr_scheduler import LRScheduler

from dream_trainer.configs.base import ConfigModel
from dream_trainer.configs.device import ddp_pipeline_problem, pipeline_layout
from dream_trainer.parallel.blocks import find_blocks
from dream_trainer.parallel.data_parallel import DDPBackend
from dream_trainer.parallel.materialize import (FullTensorInit, any_rank_failed,
                                                find_uninitialized, has_meta_tensors,
                                                materialize)
from dream_trainer.parallel.pipeline import (PipelineStages, materialize_stages, split_model,
                                             stage_ids)
from dream_trainer.parallel.pipeline_schedule import PipelineRunner
from dream_trainer.trainer.abstract import AbstractTrainer
from dream_trainer.utils.dataloader import prepare_loader
from dream_trainer.world.dims import MeshAxis

logger = logging.getLogger(__name__)

T = TypeVar("T")


class SetupConfigMixin(ConfigModel):
    """Config counterpart of ``SetupMixin``; the parallelism settings live in
    ``DeviceParameters``, so it adds no fields of its own yet."""


class SetupMixin(AbstractTrainer):
    """Builds everything ``fit()`` trains: models, optimizers, schedulers and dataloaders.

    ``configure()`` runs ``configure_models()`` under ``torch.device("meta")``: every
    ``nn.Module`` it assigns to ``self`` is a model, and none gets storage. ``setup()`` then
    runs, in this order:

    0. ``apply_pipeline_parallel(pp_mesh)`` when ``pipeline_parallel > 1``: the model is split
       into stages, steps 1-4 run once per stage of this rank (with the model attribute
       bound to that stage), and the model attribute becomes a ``PipelineStages`` holding
       them; materialization gives the weights a one-process run would have (DDP replicas
       of stages are refused: they shard with FSDP2);
    1. ``apply_tensor_parallel(tp_mesh)`` when ``tensor_parallel > 1``;
    2. ``apply_activation_checkpointing()`` when ``checkpoint_activations``;
    3. ``apply_compile()`` when ``compile_model``;
    4. ``apply_fully_shard(config)`` when ``dp_shard > 1``;
    5. materialization: ``to_empty`` on the device, every submodule's ``reset_parameters()``,
       then ``init_weights()``; a tensor left on meta or non-finite is an error naming it.
       Random initializers of sharded (DTensor) parameters draw the full tensor and keep
       the local shard, so a sharded model starts from exactly the single-process weights;
    6. ``apply_replicate(dp_mesh)`` when only ``dp_replicate > 1`` (DDP needs real tensors,
       because it broadcasts rank 0's weights when it wraps the model);
    7. ``configure_optimizers()``, ``configure_schedulers()``, ``configure_dataloaders()``
       (map-style loaders with a plain sampler get a ``ResumableSampler``, on one rank too:
       it splits the data across data-parallel ranks and can resume mid-epoch).
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._model_names: list[str] = []
        self._optimizer_names: list[str] = []
        self._scheduler_names: list[str] = []
        self._unnamed_optimizers: dict[str, torch.optim.Optimizer] = {}
        self._train_loader: Iterable[Any] | None = None
        self._val_loader: Iterable[Any] | None = None

    # -- user hooks ------------------------------------------------------------------------
    @abstractmethod
    def configure_models(self) -> None:
        """Assign the models to ``self``; runs on the meta device, so no weights exist yet."""

    def init_weights(self) -> None:
        """Initialize weights after materialization; the default keeps ``reset_parameters()``."""

    @abstractmethod
    def configure_optimizers(self) -> Mapping[nn.Module, torch.optim.Optimizer] | None:
        """Assign optimizers to ``self`` (over the materialized, wrapped parameters).

        Returns:
            Optionally ``{model: optimizer}``; optimizers only returned are named
            ``<model attribute>_optimizer``.
        """

    def configure_schedulers(self) -> None:
        """Optionally assign ``LRScheduler`` attributes; ``step()`` steps each with its
        optimizer."""

    @abstractmethod
    def configure_dataloaders(self) -> tuple[Iterable[Any], Iterable[Any] | None]:
        """Return ``(train_loader, val_loader)``; ``val_loader`` may be None."""

    # -- parallelism hooks -------------------------------------------------------------------------
    def apply_pipeline_parallel(self, pp_mesh: DeviceMesh) -> list[nn.Module]:
        """Split the model into pipeline stages; return this rank's, one per ``stage_ids``.

        The default is ``split_model(model, stage_ids(...), num_stages)``: the
        blocks ``find_blocks`` finds are split evenly, modules before them go to the first
        stage and after them to the last, and everything of other stages is set to None,
        so the model's ``forward`` must skip None modules. Override it for a model that does
        not follow that convention; return modules whose parameter names are the model's.

        Args:
            pp_mesh: The pipeline mesh.

        Returns:
            One module per stage in ``stage_ids(pp_mesh.get_local_rank(), pp_mesh.size(),
            device_parameters)``, in that order.
        """
        params = self.config.device_parameters
        ids = stage_ids(pp_mesh.get_local_rank(), pp_mesh.size(), params)
        num_stages = pp_mesh.size() * pipeline_layout(params, pp_mesh.size())[0]
        return split_model(getattr(self, _pipelined_model(self)), ids, num_stages)

    def apply_tensor_parallel(self, tp_mesh: DeviceMesh) -> None:
        """Parallelize the models over ``tp_mesh`` (``parallelize_module``).

        There is no sensible default for an arbitrary model, so a subclass that sets
        ``tensor_parallel > 1`` must override this.
        """
        raise NotImplementedError(
            f"tensor_parallel={tp_mesh.size()} needs a plan: override "
            f"{type(self).__name__}.apply_tensor_parallel(tp_mesh)"
        )

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

    # -- AbstractTrainer ---------------------------------------------------------------------
    def teardown(self) -> None:
        """Unwrap DDP models, so that ``self.model`` is the plain module after ``fit()``.

        A DDP wrapper keeps the gloo process group alive past ``destroy_process_group()``;
        freed later (at interpreter exit, say) its group's destructor can deadlock with a
        gloo thread waiting for the GIL (pytorch#56297).
        """
        for name, model in self.named_models().items():
            if isinstance(model, DistributedDataParallel):
                setattr(self, name, model.module)
            elif isinstance(model, PipelineStages):
                model.release()
        gc.collect()
        super().teardown()

    def configure(self) -> None:
        """Run ``configure_models()`` on the meta device and record the models it assigned.

        Raises:
            ValueError: if it assigned no ``nn.Module``.
        """
        before = dict(vars(self))
        with torch.device("meta"):
            self.configure_models()
        self._model_names = _assigned(self, before, nn.Module)
        if not self._model_names:
            raise ValueError(
                f"{type(self).__name__}.configure_models() assigned no nn.Module to self: "
                "create the models there, e.g. `self.model = nn.Linear(4, 2)`"
            )

    def setup(self) -> None:
        """Parallelize, materialize and wrap the models; then optimizers, schedulers, data."""
        dims = self.world.dims
        replicate = dims.dp_replicate > 1 and dims.dp_shard == 1
        if dims.pp > 1:
            self._setup_pipeline(replicate)
        else:
            self._apply_parallelism()
            self._materialize_models()
            if replicate:
                mesh = self.world.get_mesh(MeshAxis.DP_REPLICATE)
                assert mesh is not None
                self.apply_replicate(mesh)
        self._setup_optimizers()
        self._setup_schedulers()
        self._setup_dataloaders()

    def _apply_parallelism(self) -> None:
        params = self.config.device_parameters
        dims = self.world.dims
        if dims.tp > 1:
            tp_mesh = self.world.get_mesh(MeshAxis.TP)
            assert tp_mesh is not None
            self.apply_tensor_parallel(tp_mesh)
        if params.checkpoint_activations:
            self.apply_activation_checkpointing()
        if params.compile_model:
            self.apply_compile()
        if dims.dp_shard > 1:
            self.apply_fully_shard(self._fully_shard_config())

    def _setup_pipeline(self, replicate: bool) -> None:
        """Split, parallelize each stage, materialize this rank's stages, wrap them.

        Raises:
            ValueError: if the data-parallel degree resolved to DDP replicas.
        """
        if replicate:
            raise ValueError(ddp_pipeline_problem(self.world.dims.pp,
                                                  self.world.dims.dp_replicate))
        name = _pipelined_model(self)
        model = getattr(self, name)
        reference = copy.deepcopy(model) if has_meta_tensors(model) else None
        pp_mesh = self.world.get_mesh(MeshAxis.PP)
        assert pp_mesh is not None
        params = self.config.device_parameters
        ids = stage_ids(pp_mesh.get_local_rank(), pp_mesh.size(), params)
        per_rank, microbatches = pipeline_layout(params, pp_mesh.size())
        stages = self.apply_pipeline_parallel(pp_mesh)
        if len(stages) != len(ids):
            raise ValueError(f"apply_pipeline_parallel returned {len(stages)} stages; this rank "
                             f"holds {len(ids)} (stages {ids})")
        stages = [self._on_stage(name, stage, self._apply_parallelism) for stage in stages]
        self.world.seed(self.config.seed)
        if reference is None:
            for stage in stages:
                stage.to(self.world.device)
        else:
            materialize_stages(reference, stages, self.world.device)
        runner = PipelineRunner(params.pipeline_schedule, microbatches, ids,
                                pp_mesh.size() * per_rank, pp_mesh.size(), self._pp_group,
                                self.world.device)
        container = PipelineStages(stages, ids, pp_mesh.size() * per_rank, runner)
        setattr(self, name, container)
        self._init_weights()

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

    def _materialize_models(self) -> None:
        device = self.world.device
        # Re-seed so the weights depend only on the seed, whatever configure_models drew.
        self.world.seed(self.config.seed)
        for model in self.named_models().values():
            if has_meta_tensors(model):
                materialize(model, device)
            else:
                model.to(device)
        self._init_weights()

    def _init_weights(self) -> None:
        """Run ``init_weights()``, then require every tensor to be initialized."""
        device = self.world.device
        with FullTensorInit():
            self.init_weights()
        bad = [entry for name, model in self.named_models().items()
               for entry in find_uninitialized(name, model)]
        if any_rank_failed(bool(bad), device):
            raise RuntimeError(
                "some model tensors were never initialized: "
                + (", ".join(bad[:10]) if bad else "(found on another rank)")
                + (f" and {len(bad) - 10} more" if len(bad) > 10 else "")
                + ". Give their module a reset_parameters() method or set them in "
                "init_weights() (buffers computed in __init__ are lost on the meta device)"
            )

    def _setup_optimizers(self) -> None:
        before = dict(vars(self))
        returned = self.configure_optimizers()
        self._optimizer_names = _assigned(self, before, torch.optim.Optimizer)
        self._unnamed_optimizers = {}
        if returned is not None:
            if not isinstance(returned, Mapping):
                raise TypeError(
                    "configure_optimizers() must return None or {model: optimizer}, got "
                    f"{type(returned).__name__}"
                )
            known = {id(opt) for opt in self.named_optimizers().values()}
            model_names = {id(model): name for name, model in self.named_models().items()}
            for model, optimizer in returned.items():
                if not isinstance(optimizer, torch.optim.Optimizer) or id(model) not in model_names:
                    raise TypeError(
                        "configure_optimizers() must map models assigned in configure_models "
                        f"to optimizers; got {type(model).__name__} -> {type(optimizer).__name__}"
                    )
                if id(optimizer) not in known:
                    self._unnamed_optimizers[f"{model_names[id(model)]}_optimizer"] = optimizer
        if not self.named_optimizers():
            raise ValueError(
                f"{type(self).__name__}.configure_optimizers() created no optimizer: assign "
                "one, e.g. `self.optimizer = torch.optim.AdamW(self.model.parameters())`"
            )

    def _setup_schedulers(self) -> None:
        before = dict(vars(self))
        self.configure_schedulers()
        self._scheduler_names = _assigned(self, before, LRScheduler)

    def _setup_dataloaders(self) -> None:
        loaders = self.configure_dataloaders()
        if not (isinstance(loaders, tuple) and len(loaders) == 2):
            raise TypeError(
                "configure_dataloaders() must return (train_loader, val_loader); return "
                "(train_loader, None) for no validation"
            )
        train, val = loaders
        if train is None:
            raise ValueError("configure_dataloaders() returned no train loader")
        seed = self.config.seed if self.config.seed is not None else 0
        world = self.world
        self._train_loader = prepare_loader(train, world.dp_size, world.dp_rank, seed)
        self._val_loader = prepare_loader(val, world.dp_size, world.dp_rank, seed)

    # -- accessors ---------------------------------------------------------------------------
    def named_models(self) -> dict[str, nn.Module]:
        return {name: getattr(self, name) for name in self._model_names}

    def named_optimizers(self) -> dict[str, torch.optim.Optimizer]:
        named = {name: getattr(self, name) for name in self._optimizer_names}
        return {**named, **self._unnamed_optimizers}

    def named_schedulers(self) -> dict[str, LRScheduler]:
        return {name: getattr(self, name) for name in self._scheduler_names}

    @property
    def train_dataloader(self) -> Iterable[Any]:
        if self._train_loader is None:
            raise RuntimeError("the train dataloader exists only after setup()")
        return self._train_loader

    @property
    def val_dataloader(self) -> Iterable[Any] | None:
        return self._val_loader


def _pipelined_model(trainer: SetupMixin) -> str:
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


def _assigned(owner: object, before: dict[str, Any], kind: type) -> list[str]:
    """Attributes of ``owner`` of type ``kind`` that are new or replaced since ``before``."""
    return [name for name, value in vars(owner).items()
            if isinstance(value, kind) and before.get(name) is not value]
