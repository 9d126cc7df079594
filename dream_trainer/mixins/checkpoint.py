"""``CheckpointMixin``: full-state DCP checkpoints, resume, retention and preemption."""

from __future__ import annotations

import contextlib
import logging
import re
from concurrent.futures import Future
from types import ModuleType
from typing import Any

import torch
import torch.distributed as dist
from pydantic import Field

from dream_trainer.checkpoint.agreement import (check_shapes, commit, find_problem, gather,
                                                load_failure, log_config_changes,
                                                saved_config_or_none, take_lock)
from dream_trainer.checkpoint.directory import (CONFIG, INFO, METADATA, CheckpointError,
                                                CheckpointInfo, complete_checkpoints, is_complete,
                                                step_dir, step_dirs)
from dream_trainer.checkpoint.early_checks import check_checkpoint_storage
from dream_trainer.checkpoint.frozen import FrozenWeights
from dream_trainer.checkpoint.resume_report import ResumePosition
from dream_trainer.checkpoint.retention import rotate
from dream_trainer.checkpoint.rng import resized_streams, set_rng_state
from dream_trainer.checkpoint.state import SHARED, TrainingState, check_shared, digest
from dream_trainer.checkpoint.storage import location, storage_for
from dream_trainer.checkpoint.storage_base import Location, RunLockLike
from dream_trainer.checkpoint.trust import safe_reader
from dream_trainer.checkpoint.write_errors import explain_write_errors
from dream_trainer.configs.base import ConfigModel
from dream_trainer.configs.checkpoint import CheckpointParameters
from dream_trainer.parallel.dtensor import local_tensor
from dream_trainer.trainer.abstract import AbstractTrainer, StopTraining
from dream_trainer.trainer.phases import call_through, runs_on
from dream_trainer.utils.preemption import PreemptionAgreement, PreemptionFlag
from dream_trainer.world.agree import agree_any

logger = logging.getLogger(__name__)


class CheckpointConfigMixin(ConfigModel):
    """Adds ``checkpoint_parameters`` to a trainer config."""

    checkpoint_parameters: CheckpointParameters = Field(default_factory=CheckpointParameters)
    """Checkpoint cadence, retention and resumption."""


class CheckpointMixin(AbstractTrainer):
    """Saves and restores the complete training state with torch Distributed Checkpoint.

    Saved: models, optimizers, schedulers, the gradient scaler, the loop position (mid-epoch
    included), every callback's state, every rank's random generators, and the config (as
    ``config.json``). A checkpoint directory counts only once DCP has written its
    ``.metadata``, which happens after every rank's data: a crash mid-save leaves a directory
    that resume skips, and older checkpoints are deleted only after a newer one is complete.
    A checkpoint resumes on any layout and number of processes; only per-rank state cannot
    follow a change of that number: ``rank_state_dict()`` is then refused, and of the random
    generator streams only those of ranks both runs have carry over, which rank 0 logs in one
    warning (see ``load_checkpoint``).

    SIGTERM or SIGUSR1 make every rank save at the next optimizer step and leave ``fit()``
    normally (``preempted`` is then True), so a scheduler's preemption costs no work.

    Its work runs in ``@runs_on`` phases: user hooks that skip ``super()`` do not disable it.
    """

    config_mixin = CheckpointConfigMixin
    _epoch_ends_after_step: bool  # the loop's (BaseTrainer)
    _start_batch: int  # the micro-batch a resumed epoch starts at (LoopState)
    train_steps_per_epoch: int  # planned by the loop before post_setup (BaseTrainer)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.preempted = False
        self._checkpoint_group: dist.ProcessGroup | None = None
        self._pending_save: tuple[Future[Any], CheckpointInfo] | None = None
        self._last_saved_step: int | None = None
        self._save_at_epoch_end = False
        self._latest_results: dict[str, float] = {}
        # The result keys of the first training step and the first validation, until the
        # monitor is found among them (see _check_monitor).
        self._result_keys: dict[str, set[str]] = {}
        self._monitor_found = False
        self._pending_rng: dict[str, Any] | None = None
        self._rng_mid_epoch = False
        self._preemption = PreemptionFlag()
        self._preemption_agreement = PreemptionAgreement(self._preemption)
        self._lock: RunLockLike | None = None
        self._frozen: FrozenWeights | None = None

    @property
    def checkpoint_parameters(self) -> CheckpointParameters:
        return self.config.checkpoint_parameters  # type: ignore[attr-defined,no-any-return]

    @property
    def checkpoint_dir(self) -> Location:
        """``<root_dir>/<project>/<group>/<experiment>/checkpoints``: a ``Path``, or an
        ``ObjectPath`` when ``root_dir`` is an object-store URL."""
        config = self.config
        root = location(self.checkpoint_parameters.root_dir)
        return root / config.project / config.group / config.experiment / "checkpoints"

    # -- phases ----------------------------------------------------------------------------
    @runs_on("pre_configure")
    def _check_storage(self) -> None:
        # Before the models are built: a missing bucket found after that costs their setup.
        if self.checkpoint_parameters.enabled:
            check_checkpoint_storage(self.checkpoint_dir, self.checkpoint_parameters.resume,
                                     self.world)

    @runs_on("post_setup")
    def _checkpoint_post_setup(self) -> None:
        # DCP's own collectives run on a separate gloo group: an async save in a background
        # thread on the training group would interleave with training collectives.
        self._checkpoint_group = self.world.new_group("gloo")
        if self.world.world_size > 1:
            # Ranks agree on preemption through a group of its own (see PreemptionAgreement).
            self._preemption_agreement = PreemptionAgreement(
                self._preemption, self.world.new_group("gloo"),
                seconds=self.checkpoint_parameters.preemption_poll_seconds)
        if self.checkpoint_parameters.enabled:
            self._lock = take_lock(self.checkpoint_dir, self.world.rank,
                                   self.world.world_size, self._checkpoint_group)
            self._resume()

    @runs_on("teardown")
    def _release_lock(self) -> None:
        if self._lock is not None:
            self._lock.release()
            self._lock = None

    @runs_on("pre_fit")
    def _install_preemption(self) -> None:
        self._preemption.install()

    @runs_on("pre_epoch")
    def _restore_rng_at_epoch(self) -> None:
        if self._pending_rng is not None and not self._rng_mid_epoch:
            self._restore_rng()

    @runs_on("pre_train_epoch")
    def _restore_rng_mid_epoch(self) -> None:
        # Mid-epoch checkpoints were taken after this epoch's loader iterator drew its seed;
        # the loop has just recreated the iterator, so the generators are restored now.
        if self._pending_rng is not None:
            self._restore_rng()

    @runs_on("end_of_step")
    def _note_train_keys(self) -> None:
        # Before a save at this step. Once per run: the step's results as every rank combined
        # them (a collective), so that every rank decides alike.
        if self._monitor_unchecked("training"):
            self._check_monitor("training", self.reduce_step_result())

    @runs_on("end_of_step")
    def _checkpoint_end_of_step(self) -> None:
        # After every post_train_batch hook, callbacks' included: their state is current.
        enabled = self.checkpoint_parameters.enabled
        if self._preemption_requested():
            saved = (f"checkpoint saved to {self.save_checkpoint(asynchronous=False)}"
                     if enabled else "nothing saved: checkpoint_parameters.enabled is False")
            self.preempted = True
            self._preemption.uninstall()
            signal = self._preemption.signal
            by = signal.name if signal else "a signal on another rank"
            raise StopTraining(f"preempted by {by}; {saved}")
        every = self.checkpoint_parameters.every_n_steps
        if not (enabled and every is not None and self.global_step % every == 0):
            return
        if self._epoch_ends_after_step:
            # Saved after the epoch's end, at this same step: saved now, it would hold the
            # state before that end, and the epoch-end and final saves at this step would
            # keep it, so a run resumed from the newest checkpoint would end the epoch again.
            self._save_at_epoch_end = True
        else:
            self.save_checkpoint()

    @runs_on("post_train_epoch")
    def _note_train_results(self, result: dict[str, Any]) -> None:
        self._latest_results.update(result)

    @runs_on("post_val_epoch")
    def _note_val_results(self, result: dict[str, Any]) -> None:
        if not (self.sanity_checking or self.evaluating):
            self._latest_results.update(result)
        if not self.evaluating and self._monitor_unchecked("validation"):
            self._check_monitor("validation", result)

    @runs_on("post_epoch", after_bases=True)
    def _checkpoint_post_epoch(self) -> None:
        every = self.checkpoint_parameters.every_n_epochs
        due = every is not None and (self.current_epoch + 1) % every == 0
        if self.checkpoint_parameters.enabled and (due or self._save_at_epoch_end):
            self.save_checkpoint()
        self._save_at_epoch_end = False

    @runs_on("post_fit", after_bases=True)
    def _checkpoint_post_fit(self) -> None:
        self._preemption_agreement.finish()
        if self.checkpoint_parameters.enabled:
            self.save_checkpoint(asynchronous=False)
        self._preemption.uninstall()

    @runs_on("on_exception")
    def _checkpoint_on_exception(self, exception: BaseException) -> None:
        # An in-flight async save is not awaited: its peers may be gone. It never wrote its
        # .metadata, so resume skips it.
        self._preemption.uninstall()

    # -- saving ------------------------------------------------------------------------------
    def save_checkpoint(self, asynchronous: bool | None = None) -> Location:
        """Save the full state to ``checkpoint_dir/step_<global_step>`` (collective).

        At most one asynchronous save is in flight: a new save first waits for it.

        Args:
            asynchronous: Write in the background; ``None`` follows ``async_save``.

        Returns:
            The checkpoint directory (complete once any async write finishes).

        Raises:
            CheckpointError: if checkpointing is disabled, the model holds non-finite
                values, or the write fails.
        """
        if not self.checkpoint_parameters.enabled:
            raise CheckpointError("save_checkpoint() called with checkpointing disabled "
                                  "(checkpoint_parameters.enabled=False): nothing is written")
        self._finish_pending_save()
        path = step_dir(self.checkpoint_dir, self.global_step)
        if self._last_saved_step == self.global_step:
            return path
        self._refuse_non_finite()
        frozen = self._frozen_weights
        info = CheckpointInfo(path, self.global_step, self.current_epoch, self._monitor_value())
        if asynchronous is None:
            asynchronous = self.checkpoint_parameters.async_save
        storage = storage_for(path)
        with self._explain_write_errors(path):
            if self.world.is_rank_zero:
                if storage.is_dir(path):  # a save at this step that never completed
                    storage.remove_tree(path)
                storage.make_dir(path)
                storage.write_bytes(path / CONFIG,
                                    self.config.model_dump_json(indent=2).encode())
                frozen.write(path)
            self._barrier()
            self._check_shared_state()
            state = {"state": TrainingState(self, left_out=frozen.left_out())}
            if asynchronous:
                future = _dcp().async_save(state, checkpoint_id=str(path),
                                           storage_writer=storage.writer(path),
                                           process_group=self._checkpoint_group)
                self._pending_save = (future, info)  # type: ignore[assignment]
            else:
                _dcp().save(state, checkpoint_id=str(path), storage_writer=storage.writer(path),
                            process_group=self._checkpoint_group)
        if not asynchronous:
            self._committed(info)
        self._last_saved_step = self.global_step
        return path

    @property
    def _frozen_weights(self) -> FrozenWeights:
        """What the checkpoints leave out, found (collectively) at the first save or load."""
        if self._frozen is None:
            self._frozen = FrozenWeights.of(self)
        return self._frozen

    def _check_shared_state(self) -> None:
        """``extra_state_dict()`` is saved once: it must be the same on every rank."""
        if self.world.world_size == 1:
            return
        mine = {key: digest(value)
                for key, value in call_through(self, "extra_state_dict").items()}
        check_shared(gather(mine, self.world.world_size, self._checkpoint_group))

    def _refuse_non_finite(self) -> None:
        """A checkpoint of NaN/inf weights would poison every resume: refuse to write it."""
        # Frozen weights are skipped: no step changes them (a LoRA base is most of the model).
        bad = [f"{name}.{param_name}" for name, model in self.named_models().items()
               for param_name, param in model.named_parameters()
               if param.requires_grad and not bool(torch.isfinite(local_tensor(param)).all())]
        if agree_any(bool(bad), self.world.device):
            raise CheckpointError(
                f"not saving step {self.global_step}: the model has non-finite values"
                + (f" in {', '.join(bad[:5])}" if bad else " on another rank")
                + "; the last complete checkpoint is kept (see NanGuard to skip such steps)"
            )

    def _finish_pending_save(self) -> None:
        if self._pending_save is not None:
            future, info = self._pending_save
            self._pending_save = None
            with self._explain_write_errors(info.path):
                future.result()
            self._committed(info)

    def _explain_write_errors(self, path: Location) -> contextlib.AbstractContextManager[None]:
        return explain_write_errors(path, self.checkpoint_dir)

    def _committed(self, info: CheckpointInfo) -> None:
        """Checksum and complete the checkpoint, then apply retention (collective)."""
        with self._explain_write_errors(info.path):  # reads and writes the storage too
            commit(info, self.world.rank, self.world.world_size, self._checkpoint_group)
        if self.world.is_rank_zero:
            logger.info("saved checkpoint %s", info.path)
            rotate(self.checkpoint_dir, self.checkpoint_parameters,
                   self._pending_save[1].path if self._pending_save else None)

    def _monitor_value(self) -> float | None:
        """The score of a checkpoint saved now: ``monitor``'s latest epoch or validation
        value; before any has one, the current optimizer step's value of a training key
        (a collective, as the save is)."""
        monitor = self.checkpoint_parameters.monitor
        if monitor is None:
            return None
        value = self._latest_results.get(monitor)
        if value is None and monitor in self._result_keys.get("training", ()):
            value = self.reduce_step_result().get(monitor)
        return None if value is None else float(value)

    def _monitor_unchecked(self, source: str) -> bool:
        """Whether ``monitor`` is still to be looked for in ``source``'s first results."""
        params = self.checkpoint_parameters
        return params.enabled and params.monitor is not None and not self._monitor_found \
            and source not in self._result_keys

    def _check_monitor(self, source: str, result: dict[str, Any]) -> None:
        """Refuse a ``monitor`` no result has, as soon as each source of results has given
        its first: the first training step and, with validation, the first validation pass
        (a sanity check's included), not after an epoch with nothing saved.

        Raises:
            ValueError: naming the key and the keys there are.
        """
        monitor = self.checkpoint_parameters.monitor
        self._result_keys[source] = set(result)
        keys = set().union(*self._result_keys.values())
        self._monitor_found = monitor in keys
        sources = {"training"} | ({"validation"} if self.val_dataloader is not None else set())
        if self._monitor_found or set(self._result_keys) != sources:
            return
        raise ValueError(
            f"checkpoint_parameters.monitor={monitor!r} is not produced by any training or "
            f"validation step; available keys: {sorted(keys)}. Set monitor to one of them "
            "(a named validation set's keys are '<name>/<key>'), or to None to keep the "
            "newest checkpoints"
        )

    def _preemption_requested(self) -> bool:
        return self._preemption_agreement.poll()

    def _barrier(self) -> None:
        if self.world.world_size > 1:
            dist.barrier(group=self._checkpoint_group)

    # -- loading ------------------------------------------------------------------------------
    def _resume(self) -> None:
        params = self.checkpoint_parameters
        if params.resume is None:
            # Unreadable checkpoints count too: is_complete reads no file.
            earlier = [step for step, path in step_dirs(self.checkpoint_dir)
                       if is_complete(path)]
            if earlier:
                # Mixing two runs' checkpoints in one directory would let retention delete
                # the new run's and make resume="latest" pick the old run's.
                raise CheckpointError(
                    f"{self.checkpoint_dir} already holds checkpoints of an earlier run (up to "
                    f"step {earlier[-1]}) and resume=None starts a new one: set "
                    "resume='latest' to continue it, or use another experiment name or root_dir"
                )
            return
        if params.resume == "latest":
            path = self._latest_intact()
            if path is None:
                logger.info("no complete checkpoint in %s: starting fresh", self.checkpoint_dir)
                return
            self._load(path, weights_only=params.load_weights_only)
            return
        path = location(params.resume)
        if not storage_for(path).is_dir(path):
            raise CheckpointError(f"resume={str(path)!r}: no checkpoint directory there "
                                  "(use 'latest' to continue this experiment)")
        if not is_complete(path):
            raise CheckpointError(f"{path} is not a complete checkpoint: it has no "
                                  f"{METADATA} or {INFO}, so its save never finished")
        self.load_checkpoint(path, weights_only=params.load_weights_only)

    def _latest_intact(self) -> Location | None:
        """The newest checkpoint that is complete and whose files are all there, whole and
        unchanged (every rank agrees; each checksums a share of the files)."""
        for info in reversed(complete_checkpoints(self.checkpoint_dir,
                                                  warn=self.world.is_rank_zero)):
            problem = self._verify(info.path)
            if problem is None:
                return info.path
            if self.world.is_rank_zero:
                logger.warning("skipping %s: %s", info.path, problem)
        return None

    def _verify(self, path: Location) -> str | None:
        """What is wrong with the checkpoint at ``path`` on any rank, or None (collective)."""
        return find_problem(path, self.world.rank, self.world.world_size,
                            self._checkpoint_group)

    def load_checkpoint(self, path: str | Location, weights_only: bool = False) -> None:
        """Load a checkpoint written by any number of ranks (collective).

        Each rank restores the random generator streams saved by the rank of the same number;
        when the checkpoint was written by another number of processes, ranks it has no
        streams for keep their seeded generators, the streams of ranks this run lacks go
        unused, and rank 0 logs one warning saying so.

        Raises:
            CheckpointError: naming a missing or truncated file, or the keys whose shapes
                differ from this trainer's models.
        """
        path = location(path)
        problem = self._verify(path)
        if problem is not None:
            raise CheckpointError(problem)
        self._load(path, weights_only)

    def _load(self, path: Location, weights_only: bool) -> None:
        """Load a checkpoint already verified by ``_verify``."""
        from torch.distributed.checkpoint.api import CheckpointException

        # Read before the state, so that a damaged config.json is reported before a long load.
        config = saved_config_or_none(path) \
            if not weights_only and self.world.is_rank_zero else None
        trusted = self.checkpoint_parameters.trusted_globals
        reader = safe_reader(str(path), trusted)
        metadata = reader.read_metadata()
        saved = metadata.state_dict_metadata
        if not weights_only and f"state.{SHARED}" not in saved:
            raise CheckpointError(
                f"{path} was written by an older dream_trainer, which stored the loop's state "
                "in another form: resume it with that version, or load only its weights "
                "(checkpoint_parameters.load_weights_only=True)"
            )
        # A pipeline run saves optimizers flattened (see TrainingState); the nested form lists
        # each group's parameter names under param_groups.<index>.params. Read them as saved.
        nested = any(re.fullmatch(r"state\.optimizers\.[^.]+\.param_groups\.\d+\.params", key)
                     for key in saved)
        flat = not nested and any(key.startswith("state.optimizers.") for key in saved)
        state = TrainingState(self, weights_only=weights_only, saved=saved, flat_optimizers=flat,
                              source=str(path), trusted=trusted,
                              left_out=self._frozen_weights.resume(path))
        check_shapes(path, state.state_dict()["models"], metadata)
        try:
            _dcp().load({"state": state}, storage_reader=reader,
                        process_group=self._checkpoint_group)
        except CheckpointError:
            raise
        # DCP gathers every rank's failure into a CheckpointException, a BaseException; the
        # reader's own refusal (a truncated or altered file) keeps its message.
        except (Exception, CheckpointException) as exc:
            raise load_failure(exc, f"failed to load checkpoint {path}") from exc
        if weights_only:
            logger.info("loaded model weights from %s", path)
            return
        saved_world_size = state.saved_world_size
        if saved_world_size is not None and saved_world_size != self.world.world_size \
                and self.world.is_rank_zero:
            logger.warning("resuming %s: %s", path,
                           resized_streams(saved_world_size, self.world.world_size))
        self._pending_rng = state.loaded_rng
        self._rng_mid_epoch = state.resumed_mid_epoch
        self._last_saved_step = self.global_step
        log_config_changes(config, self.config.model_dump_json())
        if self.world.is_rank_zero:
            params = self.config.training_parameters  # type: ignore[attr-defined]
            ResumePosition(path, self.global_step, self.current_epoch, self._start_batch,
                           self.train_steps_per_epoch, params.gradient_accumulation_steps,
                           params.n_epochs, params.max_steps).log()

    def _restore_rng(self) -> None:
        assert self._pending_rng is not None
        set_rng_state(self._pending_rng)
        self._pending_rng = None


def _dcp() -> ModuleType:
    """``torch.distributed.checkpoint``, imported on first use: importing it takes about a
    second (it loads DTensor and sympy), which ``import dream_trainer`` should not cost."""
    import torch.distributed.checkpoint as dcp

    return dcp
