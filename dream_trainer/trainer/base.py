"""``BaseTrainer``: the training loop and its counters (the step API is in ``step_api``,
validation in ``validation``, hook dispatch in ``dispatch``)."""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any, ClassVar

from dream_trainer.configs.device import DEGREES
from dream_trainer.configs.training import TrainingParameters
from dream_trainer.data.batch import move_to_device
from dream_trainer.data.loaders import has_resumable_sampler, numbered_batches
from dream_trainer.data.stream import TrainBatches
from dream_trainer.parallel.data_parallel import DataParallelBackend, backend_for
from dream_trainer.parallel.layout import Layout
from dream_trainer.parallel.parts import PARTS, Part
from dream_trainer.parallel.precision import Precision
from dream_trainer.trainer.abstract import StopTraining
from dream_trainer.trainer.callback_collection import CallbackCollection
from dream_trainer.trainer.config import BaseTrainerConfig
from dream_trainer.trainer.dispatch import HookDispatch
from dream_trainer.trainer.epoch_plan import plan_train_steps
from dream_trainer.trainer.history import History, RecordsHistory
from dream_trainer.trainer.item_weighting import ItemWeighting
from dream_trainer.trainer.loop_state import LoopState
from dream_trainer.trainer.lifetime import torn_down
from dream_trainer.trainer.out_of_memory import failure_note
from dream_trainer.trainer.phases import check_config_mixins, runs_on
from dream_trainer.trainer.schedulers import planned_optimizer_steps
from dream_trainer.trainer.step_api import StepAPI
from dream_trainer.trainer.validation import ValidationLoop, check_result, stop_is_an_error
from dream_trainer.utils.averaging import (AgreedKeys, Number, ResultAverager, Scalars,
                                           scalars)
from dream_trainer.world.materialization import Materialization
from dream_trainer.world.world import DistributedWorld

logger = logging.getLogger(__name__)


class BaseTrainer(HookDispatch, StepAPI, ValidationLoop, LoopState, RecordsHistory):
    """The training loop: epochs, micro-batches, accumulation, validation and callbacks.

    Subclasses provide models, optimizers and data (``SetupMixin``) and the two steps.
    ``training_step`` calls ``self.backward(loss)`` and, when ``is_accumulating_gradients``
    is False, ``self.step(model, optimizer)``.

    Args:
        config: The run's configuration; never modified by the trainer.

    Raises:
        MeshMismatchError: if the mesh degrees do not fit the launched world size.
        TypeError: if a callback requires a trainer capability this class lacks, or a mixin
            needs a config mixin the config class lacks.
    """

    config: BaseTrainerConfig
    parallel_parts: ClassVar[tuple[Part, ...]] = PARTS
    """The layout's parts in their build order (``dream_trainer.parallel.parts``); a trainer
    adds a dimension of its own as ``parallel_parts = with_part(MyPart(), after="tensor")``."""

    def __init__(self, config: BaseTrainerConfig, *args: Any, **kwargs: Any) -> None:
        check_config_mixins(self, config)
        self.config = config
        # The window's length, read on every micro-batch and step: from the config, once
        # (replace_config reads it again).
        self._accumulation = config.training_parameters.gradient_accumulation_steps
        self.world = DistributedWorld(config.device_parameters)
        self.data_parallel: DataParallelBackend = backend_for(self.world.dims)
        self.layout = Layout.resolve(self.world, self.data_parallel, self.parallel_parts)
        self.precision = Precision(config.device_parameters, self.data_parallel,
                                   self.world.device)
        self._declare_step_stages()
        self.item_weighting = ItemWeighting(self.world.device)
        self.callbacks = CallbackCollection(config.callbacks)
        self._hook_calls = {}
        self.training = False
        self.sanity_checking = False
        self.evaluating = False
        self.validation_set: str | None = None
        self.global_step = 0
        self.local_batches = 0
        self.current_epoch = 0
        self._history = History()
        self._batch_idx = 0
        self._train_steps_per_epoch = 0
        # Where the current epoch stands, and where a resumed run starts (see state_dict).
        self._batches_done = 0
        self._epoch_done = False
        self._start_batch = 0
        self._resharded = False
        self._window_open = False  # micro-batches of a window ran since the last step
        # What a checkpoint at a step leaves to the resumed run (see LoopState.state_dict).
        self._validation_due = False
        self._epoch_result: dict[str, float] | None = None
        self._train_batches: TrainBatches | None = None
        self._configured = False
        # The current optimizer step's averaged entries, read only by reduce_step_result().
        self._step_results: list[tuple[Scalars, Number]] = []
        self._step_result_keys = AgreedKeys()  # the ranks check them, not gather them, per step
        self.reduced_step_result: tuple[int, dict[str, float]] | None = None
        """``(global_step, values)`` of the latest ``reduce_step_result()``, for readers on one
        rank (the progress bar); None before the first."""
        super().__init__(*args, **kwargs)
        self.callbacks.attach(self)

    # -- the lifecycle -----------------------------------------------------------------------
    def fit(self) -> History:
        """Launch, configure, set up, train; always tear the process group down.

        Returns:
            The run's ``History``: the values logged by step and epoch, and the final step.

        Raises:
            Exception: whatever a phase raised, after ``on_exception`` hooks ran and the
                failure was logged with this process's rank.
        """
        with torn_down(self):
            try:
                self.set_up()
                self._train()
            except BaseException as exc:
                self._report_failure(exc)
                raise
        return self._finish_history()

    def set_up(self, materialization: Materialization | None = None) -> None:
        """Launch, configure and set up exactly as ``fit()`` does before training.

        Afterwards the process group, the mesh, the (parallelized, materialized) models, the
        optimizers, the schedulers and the loaders exist, and the hooks up to ``post_setup``
        have run. The caller owns what was created: release it as ``fit()`` does, with
        ``teardown()`` and then ``world.shutdown()``, in a ``finally`` (also when this raises).

        Args:
            materialization: How the model tensors are created, for tools: ``dream-trainer
                plan`` passes one whose tensors have shapes but no values. By default real
                tensors, as ``fit()`` creates them. It lasts until ``world.shutdown()``.
        """
        if materialization is not None:
            self.world.materialization = materialization
        with stop_is_an_error("while the run is being set up, before training started"):
            self._launch()
            self._configure()
            self._setup()

    def replace_config(self, config: BaseTrainerConfig) -> None:
        """Run with ``config`` instead of the config given at construction, for tools that
        run a user's trainer on their own terms (a temporary checkpoint directory, logging or
        compilation off, no callbacks).

        Allowed until the models are configured: before ``fit()``/``set_up()``, or from a
        ``pre_launch``/``pre_configure`` hook. Before launch the callbacks are rebuilt from
        ``config.callbacks`` (attached again); from a hook they must stay the same. The mesh
        and the pipeline's layout cannot change: the world was resolved from the first
        config's.

        Raises:
            RuntimeError: after the models were configured, or from a hook with other
                callbacks.
            TypeError: if ``config`` is not of the trainer's config class.
            ValueError: if its mesh degrees or pipeline layout settings differ.
        """
        if type(config) is not type(self.config):
            raise TypeError(f"replace_config() takes a {type(self.config).__name__}, got "
                            f"{type(config).__name__}")
        if self._configured:
            raise RuntimeError("replace_config() after the models were configured: call it "
                               "before fit()/set_up(), or from pre_launch/pre_configure")
        fixed = (*DEGREES, "pipeline_schedule", "pipeline_microbatches",
                 "pipeline_stages_per_rank")
        old, new = self.config.device_parameters, config.device_parameters
        changed = [name for name in fixed if getattr(old, name) != getattr(new, name)]
        if changed:
            raise ValueError(f"replace_config() cannot change the mesh ({', '.join(changed)}): "
                             "the world and its layout were resolved from the first config's "
                             "degrees and pipeline settings")
        callbacks_changed = list(config.callbacks) != list(self.config.callbacks)
        if callbacks_changed and self.world.is_launched:
            raise RuntimeError("replace_config() from a hook cannot change the callbacks: "
                               "replace them before fit()/set_up()")
        self.config = config
        self._accumulation = config.training_parameters.gradient_accumulation_steps
        if callbacks_changed:
            self.callbacks = CallbackCollection(config.callbacks)
            self._hook_calls = {}
            self.callbacks.attach(self)

    def _launch(self) -> None:
        self._fire("pre_launch")
        self.world.launch()
        self.world.seed(self.config.seed)

    def _configure(self) -> None:
        self._fire("pre_configure")
        self._configured = True
        self.build_models()
        self._fire("post_configure")

    def _setup(self) -> None:
        self._fire("pre_setup")
        self.build_training()
        self._declare_model_stages()
        self._train_steps_per_epoch = plan_train_steps(self.train_dataloader,
                                                       self.training_parameters, self.world)
        self._train_batches = TrainBatches(self.train_dataloader, self._samples_per_batch)
        self._fire("post_setup")

    def _train(self) -> None:
        """Train until the schedule or a ``StopTraining`` ends it; then ``post_fit``, once."""
        try:
            self._fire("pre_fit")
            self._sanity_check()
            while self._epochs_left() and not self._max_steps_reached():
                self._run_epoch()
        except StopTraining as stop:
            logger.warning("training stopped at global step %d: %s", self.global_step, stop)
        # An early end is still the end: post_fit hooks save and release resources.
        with stop_is_an_error("in post_fit, after training ended"):
            self._fire("post_fit")

    def _epochs_left(self) -> bool:
        n_epochs = self.training_parameters.n_epochs
        return n_epochs is None or self.current_epoch < n_epochs

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
            self._epoch_result = None

    # -- training ------------------------------------------------------------------------------
    @property
    def training_parameters(self) -> TrainingParameters:
        return self.config.training_parameters

    @property
    def train_steps_per_epoch(self) -> int:
        """Optimizer steps in each epoch, as agreed by every rank during setup (0 before)."""
        return self._train_steps_per_epoch

    @property
    def is_accumulating_gradients(self) -> bool:
        """True on every micro-batch of an accumulation window but the last.

        ``step()`` may only be called when this is False.
        """
        return self.training and (self._batch_idx + 1) % self._accumulation != 0

    def _train_epoch(self) -> bool:
        """Train one epoch; return False when ``max_steps`` cut it short."""
        self._set_train_mode(True)
        assert self._train_batches is not None
        start, self._start_batch = self._start_batch, 0
        self._batches_done = start
        n_batches = self._train_steps_per_epoch * self.training_parameters.gradient_accumulation_steps
        if start < n_batches:  # results carried over are only those of a finished epoch
            self._epoch_result = None
        if start and self._resharded and not (has_resumable_sampler(self.train_dataloader)
                                              or self._train_batches.stateful):
            raise RuntimeError(
                "cannot resume mid-epoch on a different number of data-parallel ranks: the "
                "train loader has its own sampler, so its position cannot be converted; "
                "resume with the original number of ranks or from an epoch boundary"
            )
        # The iterator exists before pre_train_epoch: creating it draws from the global RNG,
        # and a resumed run restores the RNG after that draw.
        batches = self._train_batches.epoch(self.current_epoch, start, n_batches)
        self._fire("pre_train_epoch")
        if self._validation_due:  # the checkpoint's step validates after it was taken
            self._validate_after_step()
        averager = ResultAverager(self.world.device)
        for batch_idx, batch in numbered_batches(batches, start, "train"):
            if not self._train_batch(batch, batch_idx, averager):
                continue
            if self._batches_done == n_batches:
                # Before the step's checkpoint, which keeps it for a run resumed from there.
                self._epoch_result = averager.compute()
            if self._after_optimizer_step():
                break
        if self._batches_done == 0:
            raise RuntimeError(
                f"the train dataloader yielded no batches in epoch {self.current_epoch}: "
                "check that the dataset is not empty and that an iterable dataset restarts"
            )
        if self._window_open:
            self._drop_partial_window()
        self._set_train_mode(False)
        # Resumed at the epoch's end, the run trained none of its batches: it reports the
        # interrupted run's results, as the checkpoint kept them ({} from an older one);
        # resumed mid-epoch, the means over the batches it trained itself.
        result = self._epoch_result
        self._fire("post_train_epoch", averager.compute() if result is None else result)
        return self._batches_done >= n_batches or not self._max_steps_reached()

    @property
    def _epoch_ends_after_step(self) -> bool:
        """Whether the epoch ends after the optimizer step just taken, at the same global step
        (its batches are done, or ``max_steps`` is reached)."""
        accumulation = self.training_parameters.gradient_accumulation_steps
        return self._batches_done >= self._train_steps_per_epoch * accumulation \
            or self._max_steps_reached()

    @property
    def _samples_per_batch(self) -> int:
        """Samples in one micro-batch over every rank that reads training data (those of
        every replica group under fault tolerance): the unit of the data position."""
        return self.training_parameters.train_batch_size * self.world.data_shards

    @property
    def total_train_steps(self) -> int:
        """Optimizer steps ``fit()`` runs in all: every epoch's, cut at ``max_steps`` (known
        once the setup phase planned the steps per epoch: read it from ``post_setup`` on, or
        lazily, as ``warmup_decay_schedule`` does).

        Raises:
            RuntimeError: before the steps per epoch are planned.
        """
        if not self._train_steps_per_epoch:
            raise RuntimeError("total_train_steps is known once the setup phase has planned "
                               "the steps per epoch (from post_setup on); a schedule built in "
                               "configure_schedulers can read it lazily: pass "
                               "total_steps=lambda: self.total_train_steps")
        return planned_optimizer_steps(self.training_parameters, self._train_steps_per_epoch)

    @property
    def global_batch_size(self) -> int:
        """Samples in one optimizer step over every data-parallel rank:
        ``train_batch_size * gradient_accumulation_steps * dp_size`` (after launch; under
        fault tolerance, those of this replica group, so that each group's throughput
        figures count its own samples)."""
        params = self.training_parameters
        return params.train_batch_size * params.gradient_accumulation_steps * self.world.dp_size

    def _train_batch(self, batch: Any, batch_idx: int, averager: ResultAverager) -> bool:
        """Train on one micro-batch; return whether it ended an optimizer step."""
        self._batch_idx = batch_idx
        accumulation = self._accumulation
        if batch_idx % accumulation == 0:
            self.item_weighting.start_window()
            self._step_results = []
        self.item_weighting.start_micro_batch()
        if accumulation > 1:
            sync = not self.is_accumulating_gradients
            for model in self.named_models().values():
                self.data_parallel.set_gradient_sync(model, sync)
        batch = move_to_device(batch, self.world.device)
        self._fire("pre_train_batch", batch, batch_idx)
        precision = self.precision
        if precision.autocast_dtype is None:  # no context to enter and leave per micro-batch
            result = self.training_step(batch, batch_idx)
        else:
            with precision.autocast():
                result = self.training_step(batch, batch_idx)
        if not isinstance(result, dict):  # the usual result needs no call to check it
            result = check_result(result, "training_step")
        self.local_batches += 1
        self._batches_done = batch_idx + 1
        # is_accumulating_gradients, without the property's call.
        accumulating = self._window_open = self.training and (batch_idx + 1) % accumulation != 0
        if not accumulating:
            if precision.scaler is not None:  # float16: no call otherwise, as in step()
                precision.update()
            self.global_step += 1
        values, weight = scalars(result), self._result_weight(result, batch)
        averager.add(values, weight)
        self._step_results.append((values, weight))
        self._fire("post_train_batch", result, batch_idx)
        return not accumulating

    def train_window(self, batches: Iterable[Any]) -> None:
        """Train on one accumulation window outside the epoch loop, after ``set_up()``.

        Each micro-batch takes the path an epoch gives it (gradient sync, device placement,
        autocast, ``training_step``, the train-batch hooks, the counters); what follows a step
        in an epoch (validation, checkpoints) does not run. For tools that drive single steps,
        such as ``dream-trainer plan``.

        Args:
            batches: ``gradient_accumulation_steps`` micro-batches, as the train loader
                yields them.

        Raises:
            ValueError: if ``batches`` holds another number of micro-batches.
        """
        window = list(batches)
        accumulation = self.training_parameters.gradient_accumulation_steps
        if len(window) != accumulation:
            raise ValueError(
                f"train_window() got {len(window)} micro-batches but one optimizer step "
                f"takes gradient_accumulation_steps={accumulation}"
            )
        self._set_train_mode(True)
        try:
            averager = ResultAverager(self.world.device)
            for batch_idx, batch in enumerate(window):
                self._train_batch(batch, batch_idx, averager)
        finally:
            self._set_train_mode(False)

    def reduce_step_result(self) -> dict[str, float]:
        """The current optimizer step's training results: every scalar of ``training_step``'s
        result, averaged over the step's micro-batches and data-parallel ranks, each weighted
        as in the epoch means (its ``num_items``, the items it gave ``backward``, else its
        batch size); ``num_items`` itself is summed. What one process computes on the whole
        global batch.

        A collective (one all-reduce and a host sync, after a gather of the ranks' result keys
        at the first call and when they change): call it on every rank at the same step,
        after the step's last micro-batch. Repeated calls in one step reuse the first's values,
        which are kept in ``reduced_step_result``. Loggers call it on the steps they log, so
        other steps cost nothing but a list append per micro-batch.
        """
        if self.reduced_step_result is None or self.reduced_step_result[0] != self.global_step:
            averager = ResultAverager(self.world.device, self._step_result_keys)
            for values, weight in self._step_results:
                averager.add(values, weight)
            self.reduced_step_result = (self.global_step, averager.compute())
        return dict(self.reduced_step_result[1])

    def _after_optimizer_step(self) -> bool:
        """Run what follows an optimizer step; return True to end the epoch early."""
        every = self.training_parameters.val_every_n_steps
        self._validation_due = every is not None and self.global_step % every == 0 \
            and self.val_dataloader is not None
        self._fire_phase("end_of_step")
        if self.global_step == 1:
            self.world.set_timeout(self.config.device_parameters.train_timeout)
        if self._validation_due:
            self._validate_after_step()
        return self._max_steps_reached()

    def _validate_after_step(self) -> None:
        """The validation of ``val_every_n_steps``; a checkpoint taken during it counts it
        as done (a run resumed from there does not repeat it)."""
        self._validation_due = False
        self._validation_epoch(self.training_parameters.val_steps_per_epoch)
        self._set_train_mode(True)

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
        self._window_open = False
        for optimizer in self.named_optimizers().values():
            optimizer.zero_grad(set_to_none=True)

    @runs_on("teardown")
    def _teardown_callbacks(self) -> None:
        self.callbacks.teardown()

    # -- helpers ----------------------------------------------------------------------------------
    def _set_train_mode(self, training: bool) -> None:
        """Switch the models to train or eval mode; a model without trainable parameters (a
        frozen teacher, a reference model) always stays in eval mode."""
        self.training = training
        for model in self.named_models().values():
            model.train(training and any(p.requires_grad for p in model.parameters()))

    def _report_failure(self, exc: BaseException) -> None:
        where = f"epoch {self.current_epoch}, global step {self.global_step}"
        if self.training:
            where += f", batch {self._batch_idx}"
        where = f"rank {self.world.rank} of {self.world.world_size} ({where})"
        message = (f"fit() failed on {where}: {type(exc).__name__}: {exc}"
                   f"{failure_note(exc, where, self.world, self.config)}")
        logger.error(message)
        if hasattr(exc, "add_note"):
            exc.add_note(f"dream_trainer: raised on {where}")
        try:
            self._fire("on_exception", exc)
        except Exception:
            logger.exception("an on_exception hook failed while handling: %s", message)
