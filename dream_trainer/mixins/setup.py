"""``SetupMixin``: models on the meta device, parallelism, materialization, optimizers, data."""

from __future__ import annotations

import gc
import logging
import warnings
from abc import abstractmethod
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import torch
from pydantic import Field, field_validator
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.optim.lr_scheduler import LRScheduler

from dream_trainer.configs.base import ConfigModel
from dream_trainer.configs.checkpoint import url_or_path
from dream_trainer.data.loaders import prepare_loader
from dream_trainer.mixins.parallelize import ParallelizeModels
from dream_trainer.parallel.build import ModelAttributes, ModelBuild
from dream_trainer.trainer.phases import runs_on
from dream_trainer.trainer.schedulers import step_with_metric, takes_metric
from dream_trainer.trainer.validation import map_loaders, named_sets
from dream_trainer.weights.hf import DEFAULT_MAX_SHARD_BYTES, ExportFormat
from dream_trainer.weights.keys import TransformedKey

if TYPE_CHECKING:
    from dream_trainer.checkpoint.pretrained import PretrainedWeights
    from dream_trainer.checkpoint.storage import ObjectPath

logger = logging.getLogger(__name__)

T = TypeVar("T")

# What torch warns when load_state_dict copies into a parameter without storage.
_META_LOAD_WARNING = "to a meta parameter in the current model, which is a no-op"


class SetupConfigMixin(ConfigModel):
    """Config counterpart of ``SetupMixin``: where the models' starting weights come from
    (the parallelism settings live in ``DeviceParameters``)."""

    # Left to right: a URL string stays one (JSON would otherwise pick Path, folding "//").
    init_weights_from: (str | Path | list[str | Path]
                        | dict[str, str | Path | list[str | Path]] | None) = Field(
        None, union_mode="left_to_right")
    """Pretrained weights loaded after ``init_weights()``: a Hugging Face weights directory
    (``model.safetensors``, or shards with ``model.safetensors.index.json``), a
    dream_trainer checkpoint (``step_<N>``) or a peft adapter folder
    (``adapter_model.safetensors``), local or at an object-store URL
    (``s3://bucket/prefix``); a list of them read in order into one model (a peft model's
    base directory, then an adapter folder to continue); ``{model attribute: either}`` for
    several models."""
    init_weights_strict: bool = True
    """Refuse a load in which model keys are missing from the files or file keys are left
    over (one error lists both); False warns and keeps ``init_weights()`` values."""
    scheduler_monitor: str | None = None
    """The result key passed to schedulers stepped by a metric (``ReduceLROnPlateau``) after
    each of the loop's validation passes (after each training epoch without a validation
    loader); ``step()`` does not step them."""

    @field_validator("init_weights_from")
    @classmethod
    def _keep_urls(cls, value: object) -> object:
        return url_or_path(value)


class SetupMixin(ParallelizeModels):
    """Builds everything ``fit()`` trains: models, optimizers, schedulers and dataloaders.

    ``build_models()`` runs ``configure_models()`` under ``torch.device("meta")``: every
    ``nn.Module`` it assigns to ``self`` is a model, and none gets storage.
    ``build_training()`` then has the layout build them: each active part of
    ``dream_trainer.parallel.parts.PARTS`` acts on the meta models in the declared order
    (docs/concepts.md, "The build order", says what each does and when it is active),
    calling this class's ``apply_*`` hooks; under ``pipeline_parallel > 1`` the model is
    first split (``apply_pipeline_parallel``) and the parts act on each stage of this rank,
    bound to the model attribute, which becomes a ``PipelineStages``. Then:

    - materialization: ``to_empty`` on the device, every submodule's ``reset_parameters()``,
      then ``init_weights()``; a tensor left on meta or non-finite is an error naming it.
      Random initializers of sharded (DTensor) parameters draw the full tensor and keep the
      local shard, so a sharded model (or a pipeline, also with the user's
      ``init_weights()``) starts from exactly the single-process weights. A
      ``transformers`` model gets its library's own initialization before
      ``init_weights()``, so it needs none of the user's. Parameters that
      ``init_weights_from`` will set are neither initialized nor checked;
    - ``init_weights_from``: pretrained weights read into each rank's shards (keys through
      ``map_pretrained_key``; missing ones keep their values when not strict);
    - the parts that act on built models (DDP's ``apply_replicate``, which broadcasts rank
      0's weights; context parallelism finding the position buffers);
    - ``configure_optimizers()``, ``configure_schedulers()``, ``configure_dataloaders()``
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
        self._val_loader: Iterable[Any] | Mapping[str, Iterable[Any]] | None = None
        self._weights_plan: PretrainedWeights | None = None

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
    def configure_dataloaders(
            self) -> tuple[Iterable[Any], Iterable[Any] | Mapping[str, Iterable[Any]] | None]:
        """Return ``(train_loader, val_loader)``; ``val_loader`` may be None, or
        ``{name: loader}`` for several validation sets (validated in turn, their results
        and metrics prefixed ``name/``)."""

    def map_pretrained_key(self, model_name: str, key: str) -> str | TransformedKey | None:
        """The model's state-dict key for ``key`` of ``init_weights_from``'s files.

        Override to rename (``"transformer.h.0.attn"`` -> ``"layers.0.attn"``), to skip a
        key (return None: a head the new task replaces), or to change the tensor's form on
        the way (return ``dream_trainer.weights.TransformedKey(model_key, transpose=(1, 2))``,
        or one with ``to_model``/``to_file`` functions). The default keeps every key.
        """
        return key

    def map_exported_key(self, model_name: str, key: str) -> str | TransformedKey | None:
        """The key under which ``export_weights(format="hf")`` writes the model's ``key``.

        The inverse of ``map_pretrained_key``: override both together, so that an export
        loads where the pretrained weights came from. Return None to leave a key out, or a
        ``TransformedKey`` naming the file's key (its ``to_file`` is applied).
        """
        return key

    def export_weights(self, path: str | Path, format: ExportFormat = "hf",
                       dtype: torch.dtype | None = None,
                       max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
                       overwrite: bool = False,
                       merge_adapters: bool = False) -> dict[str, Path | ObjectPath]:
        """Write the models' current weights, consolidated, from any parallel layout.

        Collective: every rank calls it; each writes its own slices and rank 0 joins them
        (the ranks need a shared filesystem, or ``path`` is an object-store URL such as
        ``s3://bucket/prefix``, which they share). ``"hf"`` writes ``path/model.safetensors``,
        or shards and ``model.safetensors.index.json``, keyed by ``map_exported_key``, plus
        ``config.json`` for a ``transformers`` model; with several models each gets the
        directory ``path/<model>``. ``"safetensors"`` writes ``path/<model>.safetensors``
        with the trainer's keys. ``"peft"`` writes a peft model's LoRA adapter as
        ``PeftModel.from_pretrained`` loads it (``adapter_model.safetensors`` and
        ``adapter_config.json``; a local ``path``). ``"hf"`` with ``merge_adapters`` writes a
        peft model's base instead, each LoRA layer's weight merged (``W + scaling * B @ A``)
        under the base's keys, adapters dropped: what ``from_pretrained`` loads as the trained
        model. Tied parameters are written once, under their first key.

        Args:
            path: The output directory (created if needed) or URL; it must be empty unless
                ``overwrite`` is set.
            format: ``"hf"``, ``"safetensors"`` or ``"peft"``.
            dtype: Cast floating tensors (``torch.bfloat16``); None keeps their dtype.
            max_shard_bytes: Largest shard of an ``"hf"`` export.
            overwrite: Export into a non-empty ``path`` (an earlier export's, say): its old
                weight files are replaced once the new ones are written, other files kept.
            merge_adapters: With ``"hf"``, merge every model's LoRA adapter (peft) into its
                base's weights; the sum is rounded once, to ``dtype`` or the base weight's.

        Returns:
            The written directory (``"hf"``) or file of each model, by model name.

        Raises:
            ValueError: for an unknown format, or two keys mapped to the same name; for
                ``"peft"``, a model that is not a peft model (or holds several adapters), or
                an object-store ``path``; for ``merge_adapters``, a format other than
                ``"hf"``, a model that is not a peft model (or holds several adapters), an
                adapter that is not plain LoRA (DoRA, ``lora_bias``, ``modules_to_save``,
                ``target_parameters``, ...), or a LoRA layer on something other than a
                linear layer's untied weight.
            FileExistsError: on every rank, if ``path`` is not empty and ``overwrite`` is
                False.
            RuntimeError: when called by several ranks outside ``fit()``, whose process
                group is gone (export from a hook such as ``post_fit`` instead).
        """
        from dream_trainer.checkpoint.export import export_models

        if self.world.world_size > 1 and not torch.distributed.is_initialized():
            raise RuntimeError(
                "export_weights is collective and the process group of this "
                f"{self.world.world_size}-rank run is gone: call it during fit(), for example "
                "from post_fit(), or export a checkpoint with `dream-trainer export`")

        if format == "peft" and not merge_adapters:
            return self._export_adapters(path, dtype, overwrite)
        return export_models(self.named_models(), path, format, self.map_exported_key,
                             dtype, max_shard_bytes, overwrite, merge_adapters)

    def _export_adapters(self, path: str | Path, dtype: torch.dtype | None,
                         overwrite: bool) -> dict[str, Path | ObjectPath]:
        from dream_trainer.checkpoint.storage import location, storage_for
        from dream_trainer.weights.peft import export_adapters

        target = location(path)
        if not isinstance(target, Path):
            raise ValueError(f"format='peft' writes to a local directory, not {target}: "
                             "export there and upload the directory")
        return dict(export_adapters(self.named_models(), target, dtype, storage_for(target),
                                    overwrite))

    # -- phases (run whether or not user hooks call super()) ----------------------------------
    @runs_on("pre_configure")
    def _check_weights_sources(self) -> None:
        # Before the models are built: an unreadable bucket found after that costs their setup.
        source = getattr(self.config, "init_weights_from", None)
        if source is not None:
            from dream_trainer.checkpoint.early_checks import check_weights_sources

            check_weights_sources(source, self.world)

    @runs_on("teardown")
    def _unwrap_models(self) -> None:
        """Unwrap DDP models, so that ``self.model`` is the plain module after ``fit()``.

        A DDP wrapper keeps the gloo process group alive past ``destroy_process_group()``;
        freed later (at interpreter exit, say) its group's destructor can deadlock with a
        gloo thread waiting for the GIL (pytorch#56297). An FSDP2 model leaves cyclic garbage
        that holds the group too: collected at interpreter exit, it aborted the process
        ("terminate called without an active exception") in about 4 runs of 10 of an FSDP2
        fit followed by another trainer's failed construction. The garbage collection that
        frees them runs only when there were some (it takes 0.2-0.5 s).
        """
        from torch.distributed.fsdp import FSDPModule

        released = self.layout.teardown()
        for name, model in self.named_models().items():
            if isinstance(model, DistributedDataParallel):
                setattr(self, name, model.module)
                released = True
            elif isinstance(model, FSDPModule):
                released = True
        if released:
            gc.collect()

    def build_models(self) -> None:
        """Run ``configure_models()`` on the meta device and record the models it assigned.

        Raises:
            ValueError: if it assigned no ``nn.Module``.
            RuntimeError: if it loaded weights into a model (``load_state_dict`` on the meta
                device keeps nothing): load them in ``init_weights()``.
        """
        before = dict(vars(self))
        with warnings.catch_warnings(record=True) as caught, torch.device("meta"):
            warnings.simplefilter("always")
            self.configure_models()
        for warning in caught:
            if _META_LOAD_WARNING in str(warning.message):
                raise RuntimeError(
                    f"{type(self).__name__}.configure_models() loaded weights with "
                    "load_state_dict, but it runs on the meta device, where parameters have no "
                    "storage: the weights would be silently dropped. Load them in "
                    "init_weights(), which runs after the models are materialized (and "
                    "sharded), or set SetupConfigMixin.init_weights_from when there is one"
                )
            warnings.warn_explicit(warning.message, warning.category, warning.filename,
                                   warning.lineno, source=warning.source)
        self._model_names = _assigned(self, before, nn.Module)
        if not self._model_names:
            raise ValueError(
                f"{type(self).__name__}.configure_models() assigned no nn.Module to self: "
                "create the models there, e.g. `self.model = nn.Linear(4, 2)`"
            )

    def build_training(self) -> None:
        """Parallelize, materialize and wrap the models (as the layout does: split into
        stages under a pipeline); then optimizers, schedulers, data."""
        self.layout.build_models(ModelBuild(
            hooks=self, models=ModelAttributes(self, self._model_names),
            pretrained_weights=self._pretrained_weights, seed=self.config.seed,
            own_init_weights=type(self).init_weights is not SetupMixin.init_weights))
        self._setup_optimizers()
        self._setup_schedulers()
        self._setup_dataloaders()

    def _pretrained_weights(self) -> PretrainedWeights | None:
        """The planned ``init_weights_from`` load (sources opened, metadata only), if any."""
        source = getattr(self.config, "init_weights_from", None)
        if source is None:
            return None
        from dream_trainer.checkpoint.pretrained import PretrainedWeights

        # Kept: the checkpoints leave out the frozen weights it sets (checkpoint.frozen).
        self._weights_plan = PretrainedWeights(
            self.named_models(), source, self.map_pretrained_key,
            strict=getattr(self.config, "init_weights_strict", True))
        return self._weights_plan

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
        metric_driven = [name for name, scheduler in self.named_schedulers().items()
                         if takes_metric(scheduler)]
        if metric_driven and getattr(self.config, "scheduler_monitor", None) is None:
            raise ValueError(
                f"{', '.join(metric_driven)} steps on a metric (its step() takes a value): set "
                "scheduler_monitor to the result key to pass it, e.g. scheduler_monitor="
                "'val_loss'; it is stepped after each validation pass"
            )

    # -- metric-driven schedulers ------------------------------------------------------------
    @runs_on("post_train_epoch", after_bases=True)
    def _step_schedulers_after_training(self, result: dict[str, Any]) -> None:
        if self.val_dataloader is None:
            self._step_metric_schedulers(result, "training epoch")

    @runs_on("post_val_epoch", after_bases=True)
    def _step_schedulers_after_validation(self, result: dict[str, Any]) -> None:
        if not (self.sanity_checking or self.evaluating):
            self._step_metric_schedulers(result, "validation")

    def _step_metric_schedulers(self, result: dict[str, Any], where: str) -> None:
        step_with_metric(self.named_schedulers(), getattr(self.config, "scheduler_monitor", None),
                         result, where)

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
        params = self.config.training_parameters
        _check_batch_size(train, "train", "train_batch_size", params.train_batch_size)
        for name, loader in named_sets(val).items():
            # Only a val_batch_size that was given binds the loaders: by default each
            # validation set keeps its loader's own batch size.
            _check_batch_size(loader, _validation_kind(name), "val_batch_size",
                              params.val_batch_size if params.val_batch_size_set else None)
        seed = self.config.seed if self.config.seed is not None else 0
        world = self.world
        # Replica groups (fault tolerance) each read their own share of the training data.
        self._train_loader = prepare_loader(train, world.data_shards, world.data_shard, seed)
        self._val_loader = None if val is None else map_loaders(
            val, lambda loader: prepare_loader(loader, world.dp_size, world.dp_rank, seed,
                                               validation=True))
        # Refused now rather than at the step that would fail (a pipeline's microbatches).
        self.layout.check_batches(params, {_validation_kind(name): loader for name, loader
                                           in named_sets(self._val_loader).items()})

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
            raise RuntimeError("the train dataloader exists only after the setup phase")
        return self._train_loader

    @property
    def val_dataloader(self) -> Iterable[Any] | Mapping[str, Iterable[Any]] | None:
        """The validation loader, ``{name: loader}`` for several sets, or None."""
        return self._val_loader


def _validation_kind(name: str | None) -> str:
    return "validation" if name is None else f"validation {name!r}"


def _check_batch_size(loader: Any, kind: str, field: str, expected: int | None) -> None:
    """A loader's own batch size must be the configured one, which the loop's arithmetic
    (global batch size, resume offsets, throughput) relies on."""
    actual = getattr(loader, "batch_size", None)
    if loader is None or actual is None or expected is None or actual == expected:
        return
    uses = ("the global batch size, the mid-epoch resume position and throughput are "
            "computed from it" if kind == "train" else "the run's summary and the progress "
                                                         "figures are computed from it")
    raise ValueError(
        f"the {kind} loader has batch_size={actual} but training_parameters.{field}={expected}: "
        f"they must agree, because {uses}; build the loader with "
        f"batch_size=config.training_parameters.{field}, or set {field}={actual}"
    )


def _assigned(owner: object, before: dict[str, Any], kind: type) -> list[str]:
    """Attributes of ``owner`` of type ``kind`` that are new or replaced since ``before``."""
    return [name for name, value in vars(owner).items()
            if isinstance(value, kind) and before.get(name) is not value]
