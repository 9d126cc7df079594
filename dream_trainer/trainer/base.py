"""``BaseTrainer``: the training loop, its counters, and the step API."""

from __future__ import annotations

import contextlib
import itertools
import logging
from collections.abc import Iterable, Mapping
from typing import Any

import torch
import torch.distributed as dist
from pydantic import Field, model_validator
from torch import nn
from torch.optim.lr_scheduler import LRScheduler

from dream_trainer.callbacks.collection import CallbackCollection
from dream_trainer.configs.device import pipeline_layout
from dream_trainer.configs.training import TrainingParameters
from dream_trainer.parallel.data_parallel import DataParallelBackend, backend_for
from dream_trainer.parallel.dtensor import full_value
from dream_trainer.parallel.grad_norm import clip_grad_norm
from dream_trainer.parallel.pipeline import PipelineStages
from dream_trainer.parallel.pipeline_schedule import LossFn
from dream_trainer.parallel.precision import Precision
from dream_trainer.trainer.abstract import AbstractTrainer, AbstractTrainerConfig, StopTraining
from dream_trainer.trainer.item_weighting import ItemWeighting
from dream_trainer.utils.averaging import ResultAverager
from dream_trainer.utils.batch import move_to_device
from dream_trainer.utils.dataloader import (epoch_batches, has_resumable_sampler,
                                            numbered_batches, set_sampler_epoch)
from dream_trainer.world.dims import MeshAxis
from dream_trainer.world.world import DistributedWorld

logger = logging.getLogger(__name__)


class BaseTrainerConfig(AbstractTrainerConfig):
    """Adds the training schedule and the callbacks to the run identity."""

    training_parameters: TrainingParameters
    """Epochs, batch sizes, accumulation, validation cadence, clipping."""
    callbacks: CallbackCollection = Field(default_factory=CallbackCollection)
    """Callbacks whose hooks run during ``fit()``, in this order."""

    @model_validator(mode="after")
    def _check_pipeline_batches(self) -> BaseTrainerConfig:
        # Batch sizes live apart from the pipeline settings, so their fit is checked here; a
        # degree of "auto" is checked on the first batch instead (see PipelineRunner).
        params = self.device_parameters
        if params.pipeline_parallel in (1, "auto"):
            return self
        _, microbatches = pipeline_layout(params, params.pipeline_parallel)
        for field in ("train_batch_size", "val_batch_size"):
            size = getattr(self.training_parameters, field)
            if size % microbatches:
                raise ValueError(
                    f"training_parameters.{field}={size} does not split into "
                    f"device_parameters.pipeline_microbatches={microbatches} (pipeline "
                    f"microbatches are equal slices of each batch): make {field} a multiple "
                    f"of {microbatches}, or set pipeline_microbatches to a divisor of it"
                )
        return self


class BaseTrainer(AbstractTrainer):
    """The training loop: epochs, micro-batches, accumulation, validation and callbacks.

    Subclasses provide models, optimizers and data (``SetupMixin``) and the two steps.
    ``training_step`` calls ``self.backward(loss)`` and, when ``is_accumulating_gradients``
    is False, ``self.step(model, optimizer)``.

    Args:
        config: The run's configuration; never modified by the trainer.

    Raises:
        MeshMismatchError: if the mesh degrees do not fit the launched world size.
        TypeError: if a callback requires a trainer capability this class lacks.
    """

    config: BaseTrainerConfig

    def __init__(self, config: BaseTrainerConfig, *args: Any, **kwargs: Any) -> None:
        self.config = config
        self.world = DistributedWorld(config.device_parameters)
        self.data_parallel: DataParallelBackend = backend_for(self.world.dims)
        self.precision = Precision(config.device_parameters, self.world.dims, self.world.device)
        self.item_weighting = ItemWeighting(self.world.device)
        self.callbacks = CallbackCollection(config.callbacks)
        self.training = False
        self.sanity_checking = False
        self.global_step = 0
        self.local_batches = 0
        self.current_epoch = 0
        self._batch_idx = 0
        self._train_steps_per_epoch = 0
        # Where the current epoch stands, and where a resumed run starts (see state_dict).
        self._batches_done = 0
        self._epoch_done = False
        self._start_batch = 0
        self._resharded = False
        super().__init__(*args, **kwargs)
        self.callbacks.attach(self)

    # -- the lifecycle -----------------------------------------------------------------------
    def fit(self) -> None:
        """Launch, configure, set up, train; always tear the process group down.

        Raises:
            Exception: whatever a phase raised, after ``on_exception`` hooks ran and the
                failure was logged with this process's rank.
        """
        completed = False
        try:
            self._launch()
            self._configure()
            self._setup()
            self._train()
            completed = True
        except StopTraining as stop:
            logger.warning("training stopped at global step %d: %s", self.global_step, stop)
            self._fire("post_fit")  # an early end is still the end: hooks release resources
            completed = True
        except BaseException as exc:
            self._report_failure(exc)
            raise
        finally:
            try:
                self.teardown()
            finally:
                self.world.shutdown(graceful=completed)

    def _launch(self) -> None:
        self._fire("pre_launch")
        self.world.launch()
        self.world.seed(self.config.seed)

    def _configure(self) -> None:
        self._fire("pre_configure")
        self.configure()
        self._fire("post_configure")

    def _setup(self) -> None:
        self._fire("pre_setup")
        self.setup()
        self._train_steps_per_epoch = self._plan_train_steps()
        self._fire("post_setup")

    def _train(self) -> None:
        self._fire("pre_fit")
        self._sanity_check()
        while self.current_epoch < self.training_parameters.n_epochs and not self._max_steps_reached():
            self._run_epoch()
        self._fire("post_fit")

    def _sanity_check(self) -> None:
        steps = self.training_parameters.num_sanity_val_steps
        if steps == 0 or self.val_dataloader is None:
            return
        self.sanity_checking = True
        try:
            self._validation_epoch(steps)
        finally:
            self.sanity_checking = False

    def _run_epoch(self) -> None:
        self._fire("pre_epoch")
        complete = self._train_epoch()
        if self.val_dataloader is not None and self.training_parameters.val_every_n_steps is None:
            self._validation_epoch(self.training_parameters.val_steps_per_epoch)
        # An epoch cut short by max_steps stays current, so a resume with a larger budget
        # finishes its remaining batches.
        self._epoch_done = complete
        self._fire("post_epoch")
        if complete:
            self.current_epoch += 1
            self._epoch_done = False
            self._batches_done = 0

    # -- training ------------------------------------------------------------------------------
    @property
    def training_parameters(self) -> TrainingParameters:
        return self.config.training_parameters

    @property
    def is_accumulating_gradients(self) -> bool:
        """True on every micro-batch of an accumulation window but the last.

        ``step()`` may only be called when this is False.
        """
        accumulation = self.training_parameters.gradient_accumulation_steps
        return self.training and (self._batch_idx + 1) % accumulation != 0

    def _train_epoch(self) -> bool:
        """Train one epoch; return False when ``max_steps`` cut it short."""
        self._set_train_mode(True)
        set_sampler_epoch(self.train_dataloader, self.current_epoch)
        start, self._start_batch = self._start_batch, 0
        self._batches_done = start
        n_batches = self._train_steps_per_epoch * self.training_parameters.gradient_accumulation_steps
        if start and self._resharded and not has_resumable_sampler(self.train_dataloader):
            raise RuntimeError(
                "cannot resume mid-epoch on a different number of data-parallel ranks: the "
                "train loader has its own sampler, so its position cannot be converted; "
                "resume with the original number of ranks or from an epoch boundary"
            )
        # The iterator exists before pre_train_epoch: creating it draws from the global RNG,
        # and a resumed run restores the RNG after that draw.
        batches = epoch_batches(self.train_dataloader, start, n_batches, self._samples_per_batch)
        self._fire("pre_train_epoch")
        averager = ResultAverager(self.world.device)
        for batch_idx, batch in numbered_batches(batches, start, "train"):
            self._train_batch(batch, batch_idx, averager)
            if not self.is_accumulating_gradients and self._after_optimizer_step():
                break
        if self._batches_done == 0:
            raise RuntimeError(
                f"the train dataloader yielded no batches in epoch {self.current_epoch}: "
                "check that the dataset is not empty and that an iterable dataset restarts"
            )
        if self.is_accumulating_gradients:
            self._drop_partial_window()
        self._set_train_mode(False)
        self._fire("post_train_epoch", averager.compute())
        return self._batches_done >= n_batches or not self._max_steps_reached()

    @property
    def _samples_per_batch(self) -> int:
        """Samples in one micro-batch over every data-parallel rank."""
        return self.training_parameters.train_batch_size * self.world.dp_size

    @property
    def global_batch_size(self) -> int:
        """Samples in one optimizer step over every data-parallel rank:
        ``train_batch_size * gradient_accumulation_steps * dp_size`` (after launch)."""
        return self._samples_per_batch * self.training_parameters.gradient_accumulation_steps

    def _train_batch(self, batch: Any, batch_idx: int, averager: ResultAverager) -> None:
        self._batch_idx = batch_idx
        if batch_idx % self.training_parameters.gradient_accumulation_steps == 0:
            self.item_weighting.start_window()
        self.item_weighting.start_micro_batch()
        if self.training_parameters.gradient_accumulation_steps > 1:
            sync = not self.is_accumulating_gradients
            for model in self.named_models().values():
                self.data_parallel.set_gradient_sync(model, sync)
        batch = move_to_device(batch, self.world.device)
        self._fire("pre_train_batch", batch, batch_idx)
        with self.precision.autocast():
            result = _check_result(self.training_step(batch, batch_idx), "training_step")
        self.local_batches += 1
        self._batches_done = batch_idx + 1
        if not self.is_accumulating_gradients:
            self.precision.update()
            self.global_step += 1
        averager.update(result)
        self._fire("post_train_batch", result, batch_idx)

    def _after_optimizer_step(self) -> bool:
        """Run what follows an optimizer step; return True to end the epoch early."""
        self.end_of_step()
        if self.global_step == 1:
            self.world.set_timeout(self.config.device_parameters.train_timeout)
        every = self.training_parameters.val_every_n_steps
        if every is not None and self.global_step % every == 0 and self.val_dataloader is not None:
            self._validation_epoch(self.training_parameters.val_steps_per_epoch)
            self._set_train_mode(True)
        return self._max_steps_reached()

    def _max_steps_reached(self) -> bool:
        max_steps = self.training_parameters.max_steps
        return max_steps is not None and self.global_step >= max_steps

    def _drop_partial_window(self) -> None:
        # An iterable loader ran out mid-window: those gradients would leak into the next
        # epoch's first step, scaled for a full window they never formed.
        logger.warning(
            "epoch %d ended inside an accumulation window (batch %d); its gradients are "
            "discarded", self.current_epoch, self._batch_idx,
        )
        for optimizer in self.named_optimizers().values():
            optimizer.zero_grad(set_to_none=True)

    # -- the step API ----------------------------------------------------------------------------
    def backward(self, loss: torch.Tensor, num_items: int | torch.Tensor | None = None) -> None:
        """Backpropagate ``loss`` so that the optimizer step sees the right average.

        Without ``num_items``, ``loss`` is a mean over the micro-batch and is scaled by
        ``1 / gradient_accumulation_steps``: the update is the mean over micro-batches and
        ranks. With ``num_items=n``, ``loss`` is a *sum* over ``n`` items (valid tokens,
        say): ``step()`` then scales the gradients so that the update is the mean over every
        item of the global batch, however the items fall across micro-batches and ranks (see
        ``ItemWeighting``). With float16 the loss is also multiplied by the gradient scaler's
        scale. Gradient synchronisation is already disabled on accumulating micro-batches.

        Args:
            loss: A 0-dim loss tensor.
            num_items: How many items ``loss`` sums over (an int or a 0-dim tensor; a tensor
                is never read on the host).

        Raises:
            RuntimeError: if called outside a training step.
            ValueError: if one accumulation window mixes calls with and without
                ``num_items``.
        """
        if not self.training:
            raise RuntimeError("backward() may only be called inside training_step")
        if self.world.dims.pp > 1:
            raise RuntimeError(
                "backward() cannot run under pipeline_parallel > 1: the pipeline schedule runs "
                "forward and backward stage by stage. Replace `loss = loss_fn(self.model(x), "
                "y); self.backward(loss)` with `loss = self.forward_backward(self.model, x, "
                "target=y, loss_fn=loss_fn)`, which does the same without a pipeline"
            )
        if num_items is None:
            self.item_weighting.note_unweighted()
            accumulation = self.training_parameters.gradient_accumulation_steps
            loss = loss / accumulation if accumulation > 1 else loss
        else:
            self.item_weighting.add(num_items)
        self.precision.scale(loss).backward()

    def forward_backward(self, model: nn.Module, *inputs: Any, target: Any, loss_fn: LossFn,
                         num_items: int | torch.Tensor | None = None) -> torch.Tensor:
        """Compute ``loss_fn(model(*inputs), target)`` and backpropagate it, with or without a
        pipeline.

        Without a pipeline this is ``loss = loss_fn(model(*inputs), target)`` then
        ``backward(loss, num_items)``. Under ``pipeline_parallel > 1`` it runs the schedule:
        the inputs feed the first stage and the target the last, each is split into
        ``pipeline_microbatches`` along dim 0, and ``loss_fn`` runs per microbatch on the last
        stage; the gradients are those of the whole micro-batch, accumulated as
        ``backward()`` would. With ``loss_parallel`` the loss runs inside torch's
        ``loss_parallel()``.

        Args:
            model: The model (under a pipeline, its ``PipelineStages``).
            *inputs: The model's positional inputs.
            target: The second argument of ``loss_fn``.
            loss_fn: ``loss_fn(output, target) -> loss``: a mean over the batch, or a sum over
                ``num_items`` items when ``num_items`` is given.
            num_items: As for ``backward()``.

        Returns:
            The loss, detached: ``loss_fn``'s value on the whole micro-batch (under a
            pipeline the mean of the microbatch losses, or their sum with ``num_items``), the
            same on every rank, without a host sync.

        Raises:
            RuntimeError: if called outside a training step.
            ValueError: if the batch does not split into the pipeline's microbatches.
        """
        if not self.training:
            raise RuntimeError("forward_backward() may only be called inside training_step")
        with self._loss_context():
            if not isinstance(model, PipelineStages):
                loss = loss_fn(model(*inputs), target)
                self.backward(loss, num_items=num_items)
                return full_value(loss.detach())  # a DTensor under loss_parallel
            if num_items is None:
                self.item_weighting.note_unweighted()
                scale = 1.0 / self.training_parameters.gradient_accumulation_steps
            else:
                self.item_weighting.add(num_items)
                scale = 1.0
            return model.run(inputs, target, loss_fn, scale, num_items is not None)

    def forward_loss(self, model: nn.Module, *inputs: Any, target: Any, loss_fn: LossFn,
                     num_items: int | torch.Tensor | None = None) -> torch.Tensor:
        """``forward_backward`` without the backward and without gradients, for
        ``validation_step``: the same loss on every rank, under a pipeline or not.

        Args:
            model, inputs, target, loss_fn: As for ``forward_backward``.
            num_items: Given when ``loss_fn`` returns a sum (the microbatch losses are then
                added up, as in ``forward_backward``); not otherwise used.

        Raises:
            ValueError: if the batch does not split into the pipeline's microbatches.
        """
        with torch.no_grad(), self._loss_context():
            if not isinstance(model, PipelineStages):
                return full_value(loss_fn(model(*inputs), target).detach())
            return model.run(inputs, target, loss_fn, None, num_items is not None)

    def _loss_context(self) -> contextlib.AbstractContextManager[Any]:
        if not self.config.device_parameters.loss_parallel:
            return contextlib.nullcontext()
        from torch.distributed.tensor.parallel import loss_parallel

        return loss_parallel()

    def step(self, model: nn.Module, optimizer: torch.optim.Optimizer,
             scheduler: LRScheduler | None = None) -> torch.Tensor:
        """Unscale (float16), clip, step the optimizer, zero the gradients, step the scheduler.

        With float16 a step whose gradients overflowed is skipped by the scaler and counted in
        ``precision.skipped_steps``. After ``backward(loss, num_items=n)`` the gradients are
        first scaled to the mean over every item of the global batch.

        Args:
            model: The model whose gradient norm is measured and clipped.
            optimizer: The optimizer to step.
            scheduler: The scheduler to step; by default the one configured for ``optimizer``.

        Returns:
            The total gradient norm before clipping, a 0-dim tensor (no host sync).

        Raises:
            RuntimeError: if called on a micro-batch that is still accumulating.
        """
        if self.is_accumulating_gradients:
            raise RuntimeError(
                f"step() called on micro-batch {self._batch_idx}, which is still accumulating "
                f"(gradient_accumulation_steps={self.training_parameters.gradient_accumulation_steps}): "
                "call it only when `not self.is_accumulating_gradients`"
            )
        self._fire("pre_optimizer_step", model, optimizer)
        self.precision.unscale_(optimizer)
        if self.item_weighting.active:
            dp_mesh = self.world.dp_mesh
            self.item_weighting.scale_gradients(
                model.parameters(), None if dp_mesh is None else dp_mesh.get_group(),
                self.world.dp_size)
        pp_mesh = self.world.get_mesh(MeshAxis.PP)
        grad_norm = clip_grad_norm(model.parameters(), self.training_parameters.gradient_clip_val,
                                   pipeline_group=None if pp_mesh is None else pp_mesh.get_group())
        self.precision.step(optimizer)
        optimizer.zero_grad(set_to_none=True)
        if scheduler is None:
            scheduler = self._scheduler_for(optimizer)
        if scheduler is not None:
            scheduler.step()
        self._fire("post_optimizer_step", model, optimizer)
        return grad_norm

    def _scheduler_for(self, optimizer: torch.optim.Optimizer) -> LRScheduler | None:
        for scheduler in self.named_schedulers().values():
            if scheduler.optimizer is optimizer:
                return scheduler
        return None

    # -- validation ---------------------------------------------------------------------------------
    def run_validation(self, dataloader: Iterable[Any] | None = None,
                       max_batches: int | None = None) -> dict[str, float]:
        """One validation pass (validation hooks included); returns its averaged results.

        Inside ``fit()`` it uses the running process group. Outside it starts one for the pass
        and tears it down again; that suits plain and (once ``fit()`` unwrapped them) DDP
        models, while FSDP2 models stay bound to ``fit()``'s group: evaluate those from a
        hook such as ``post_fit``.
        """
        if self.world.is_launched:
            return self._validation_epoch(max_batches, dataloader)
        self.world.launch()
        try:
            return self._validation_epoch(max_batches, dataloader)
        finally:
            self.world.shutdown()

    def _validation_epoch(self, max_batches: int | None,
                          dataloader: Iterable[Any] | None = None) -> dict[str, float]:
        loader = dataloader if dataloader is not None else self.val_dataloader
        if loader is None:
            return {}
        self.training = False
        self._set_train_mode(False)
        self._fire("pre_val_epoch")
        averager = ResultAverager(self.world.device)
        with torch.no_grad():
            for batch_idx, batch in numbered_batches(itertools.islice(loader, max_batches), 0,
                                              "validation"):
                batch = move_to_device(batch, self.world.device)
                self._fire("pre_val_batch", batch, batch_idx)
                with self.precision.autocast():
                    result = self.validation_step(batch, batch_idx)
                result = _check_result(result, "validation_step")
                averager.update(result)
                self._fire("post_val_batch", result, batch_idx)
        result = averager.compute()
        for model in self.named_models().values():
            self.data_parallel.after_validation(model)
        self._fire("post_val_epoch", result)
        return result

    # -- helpers ----------------------------------------------------------------------------------
    def _fire(self, hook: str, *args: Any) -> None:
        """Run the trainer's own hook, then every callback's, in insertion order."""
        getattr(self, hook)(*args)
        for listener in self.callbacks.listeners(hook):
            listener(*args)

    def _set_train_mode(self, training: bool) -> None:
        self.training = training
        for model in self.named_models().values():
            model.train(training)

    def _plan_train_steps(self) -> int:
        """Optimizer steps per epoch, checked against the loader and agreed by every rank."""
        loader = self.train_dataloader
        params = self.training_parameters
        accumulation = params.gradient_accumulation_steps
        try:
            n_batches: int | None = len(loader)  # type: ignore[arg-type]
        except TypeError:
            n_batches = None
        if n_batches == 0:
            raise ValueError(
                "the train dataloader is empty (0 batches on this rank): check the dataset, "
                "and that batch_size with drop_last=True does not exceed the rank's share"
            )
        if n_batches is None:
            if params.train_steps_per_epoch is None:
                raise ValueError(
                    "the train dataloader has no length (an iterable dataset): set "
                    "training_parameters.train_steps_per_epoch"
                )
            steps = params.train_steps_per_epoch
        else:
            steps = n_batches // accumulation
            if steps == 0:
                raise ValueError(
                    f"the train dataloader has {n_batches} batches per rank, fewer than "
                    f"gradient_accumulation_steps={accumulation}: use more data or a smaller "
                    "batch or accumulation"
                )
            if params.train_steps_per_epoch is not None:
                steps = min(steps, params.train_steps_per_epoch)
            elif n_batches % accumulation:
                logger.warning(
                    "the train dataloader has %d batches, not a multiple of "
                    "gradient_accumulation_steps=%d: the last %d batches of each epoch are "
                    "not used", n_batches, accumulation, n_batches % accumulation,
                )
        return self._agree_on_steps(steps)

    def _agree_on_steps(self, steps: int) -> int:
        # Ranks with different loader lengths would otherwise wait forever in a collective.
        if not (dist.is_initialized() and self.world.world_size > 1):
            return steps
        agreed = torch.tensor([steps], dtype=torch.int64, device=self.world.device)
        dist.all_reduce(agreed, op=dist.ReduceOp.MIN)
        if int(agreed) != steps:
            logger.warning(
                "rank %d has %d optimizer steps per epoch but another rank has only %d: every "
                "rank runs %d (give every rank the same amount of data)",
                self.world.rank, steps, int(agreed), int(agreed),
            )
        return int(agreed)

    def _report_failure(self, exc: BaseException) -> None:
        where = f"epoch {self.current_epoch}, global step {self.global_step}"
        if self.training:
            where += f", batch {self._batch_idx}"
        message = (f"fit() failed on rank {self.world.rank} of {self.world.world_size} "
                   f"({where}): {type(exc).__name__}: {exc}")
        logger.error(message)
        if hasattr(exc, "add_note"):
            exc.add_note(f"dream_trainer: raised on rank {self.world.rank} of "
                         f"{self.world.world_size} ({where})")
        try:
            self._fire("on_exception", exc)
        except Exception:
            logger.exception("an on_exception hook failed while handling: %s", message)

    # -- state ------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The loop's position, the gradient scaler and every callback's state.

        The position says where a resumed run continues: the epoch, and how many of its
        micro-batches are done (0 once the epoch, validation included, has finished).
        """
        epoch, batch = ((self.current_epoch + 1, 0) if self._epoch_done
                        else (self.current_epoch, self._batches_done))
        return {
            "global_step": self.global_step,
            "current_epoch": epoch,
            "batch_in_epoch": batch,
            "samples_per_batch": self._samples_per_batch,
            "dp_size": self.world.dp_size,
            "precision": self.precision.state_dict(),
            "callbacks": self.callbacks.state_dict(),
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore what ``state_dict`` returned, converting the position to this topology.

        Raises:
            ValueError: if the samples done in the epoch do not fill whole accumulation
                windows of this run's batch size and data-parallel degree.
        """
        self.global_step = int(state_dict["global_step"])
        self.current_epoch = int(state_dict["current_epoch"])
        samples = int(state_dict.get("batch_in_epoch", 0)) * int(
            state_dict.get("samples_per_batch", self._samples_per_batch))
        window = self.global_batch_size
        if samples % window:
            raise ValueError(
                f"cannot resume mid-epoch: the checkpoint's run had read {samples} samples of "
                f"epoch {self.current_epoch}, which is not a whole number of this run's "
                f"optimizer steps ({window} samples each: train_batch_size x data-parallel "
                "ranks x gradient_accumulation_steps); use a batch configuration that "
                "divides it, or resume from an epoch-boundary checkpoint"
            )
        self._start_batch = samples // self._samples_per_batch
        self._resharded = int(state_dict.get("dp_size", self.world.dp_size)) != self.world.dp_size
        self.precision.load_state_dict(state_dict.get("precision", {}))
        self.callbacks.load_state_dict(state_dict.get("callbacks", {}))


def _check_result(result: Any, step_name: str) -> dict[str, Any]:
    if not isinstance(result, Mapping):
        raise TypeError(
            f"{step_name} must return a dict of values (for example {{'loss': loss}}), "
            f"got {type(result).__name__}"
        )
    return dict(result) if not isinstance(result, dict) else result
