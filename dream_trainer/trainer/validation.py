"""Validation passes: over one loader or several named sets, inside ``fit()`` or after it."""

from __future__ import annotations

import contextlib
import itertools
from abc import abstractmethod
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch

from dream_trainer.data.batch import batch_size_of, move_to_device
from dream_trainer.data.loaders import numbered_batches, prepare_loader
from dream_trainer.errors import StopTraining
from dream_trainer.parallel.data_parallel import DataParallelBackend
from dream_trainer.parallel.precision import Precision
from dream_trainer.trainer.abstract import AbstractTrainer
from dream_trainer.trainer.item_weighting import ItemWeighting
from dream_trainer.utils.averaging import WEIGHT_KEY, ResultAverager

Loaders = Iterable[Any] | Mapping[str, Iterable[Any]]
"""A validation loader, or several named ones."""


class ValidationLoop(AbstractTrainer):
    """The validation half of ``BaseTrainer``'s loop.

    A pass fires ``pre_val_epoch``, runs every batch of every validation set (each through
    ``validation_step`` under ``no_grad`` and eval mode), and fires ``post_val_epoch`` with
    the results: weighted means over the batches and ranks. With several named sets
    (``{"name": loader}``) each set's results, metrics included, are prefixed ``name/``.
    """

    precision: Precision
    data_parallel: DataParallelBackend
    item_weighting: ItemWeighting
    validation_set: str | None
    """The name of the validation set being run (None for a single, unnamed loader)."""

    # -- public -------------------------------------------------------------------------------
    def evaluate(self, dataloader: Loaders | None = None,
                 max_batches: int | None = None) -> dict[str, float]:
        """Run a validation pass now (hooks included) and return its results.

        Usable from a hook during ``fit()`` and after it, in every parallel mode: outside
        ``fit()`` the process group and mesh are started again for the pass (the models keep
        their layout) and torn down after it; the numbers are those of one process on the same
        weights and data. ``evaluating`` is True during the pass, so training-control
        callbacks (``EarlyStopping``) and checkpoint ranking ignore it. A ``dataloader`` given
        here (or each of a mapping of them) is split across the data-parallel ranks like the
        configured validation loader. With ``EvalMixin`` the results include its metrics.

        Args:
            dataloader: The loader, or ``{name: loader}`` for several sets (results prefixed
                ``name/``), to evaluate on; the configured validation loader(s) when None.
            max_batches: Stop each set after this many batches (every rank runs as many).

        Raises:
            ValueError: if there is no loader to evaluate on.
            RuntimeError: if a hook raises ``StopTraining`` while no training is running.
        """
        if dataloader is None and self.val_dataloader is None:
            raise ValueError("evaluate() needs a dataloader: pass one, or return a validation "
                             "loader from configure_dataloaders")
        if self.world.is_launched:
            return self._evaluation(dataloader, max_batches)
        self.world.launch()
        try:
            with stop_is_an_error("during an evaluation outside fit()"):
                return self._evaluation(dataloader, max_batches)
        finally:
            self.world.shutdown()

    # -- the pass -----------------------------------------------------------------------------
    def _evaluation(self, dataloader: Loaders | None,
                    max_batches: int | None) -> dict[str, float]:
        if dataloader is not None:
            seed = self.config.seed if self.config.seed is not None else 0
            dataloader = map_loaders(dataloader, lambda loader: prepare_loader(
                loader, self.world.dp_size, self.world.dp_rank, seed, validation=True))
        was_training, self.evaluating = self.training, True
        try:
            return self._validation_epoch(max_batches, dataloader)
        finally:
            self.evaluating = False
            if was_training:
                self._set_train_mode(True)

    def _validation_epoch(self, max_batches: int | None,
                          dataloader: Loaders | None = None) -> dict[str, float]:
        sets = named_sets(dataloader if dataloader is not None else self.val_dataloader)
        if not sets:
            return {}
        self.training = False
        self._set_train_mode(False)
        self._fire("pre_val_epoch")
        result: dict[str, Any] = {}
        with torch.no_grad():
            for name, loader in sets.items():
                self.validation_set = name
                part = self._validation_set(loader, max_batches)
                self._fire_phase("end_of_validation_set", part)
                result.update(part if name is None else
                              {f"{name}/{key}": value for key, value in part.items()})
        self.validation_set = None
        for model in self.named_models().values():
            self.data_parallel.after_validation(model)
        self._fire("post_val_epoch", result)
        return result

    def _validation_set(self, loader: Iterable[Any], max_batches: int | None) -> dict[str, Any]:
        averager = ResultAverager(self.world.device)
        batches = numbered_batches(itertools.islice(loader, max_batches), 0, "validation")
        for batch_idx, batch in batches:
            batch = move_to_device(batch, self.world.device)
            self._fire("pre_val_batch", batch, batch_idx)
            with self.precision.autocast():
                result = check_result(self.validation_step(batch, batch_idx),
                                      "validation_step")
            averager.update(result, self._result_weight(result, batch))
            self._fire("post_val_batch", result, batch_idx)
        return averager.compute()

    def _result_weight(self, result: Mapping[str, Any], batch: Any) -> int | torch.Tensor:
        """How much a step's results count in the epoch's means: the step's ``num_items``
        result, else the item count it gave ``backward``, else its batch's size."""
        if WEIGHT_KEY in result:
            return result[WEIGHT_KEY]  # type: ignore[no-any-return]
        if self.training and self.item_weighting.last_num_items is not None:
            return self.item_weighting.last_num_items
        size = batch_size_of(batch)
        return 1 if size is None else size

    # -- provided by BaseTrainer ------------------------------------------------------------------
    @abstractmethod
    def _fire(self, hook: str, *args: Any) -> None:
        """Run a hook on the trainer and every callback."""

    @abstractmethod
    def _fire_phase(self, phase: str, *args: Any) -> None:
        """Run the mixins' work at ``phase``, then the trainer's method of that name."""

    @abstractmethod
    def _set_train_mode(self, training: bool) -> None:
        """Switch the models between train and eval mode."""


def named_sets(loaders: Loaders | None) -> dict[str | None, Iterable[Any]]:
    """``{name: loader}`` for several sets, ``{None: loader}`` for one, ``{}`` for none."""
    if loaders is None:
        return {}
    if isinstance(loaders, Mapping):
        return dict(loaders)
    return {None: loaders}


def map_loaders(loaders: Loaders, function: Any) -> Loaders:
    """``function`` applied to a loader, or to each loader of a mapping."""
    if isinstance(loaders, Mapping):
        return {name: function(loader) for name, loader in loaders.items()}
    return function(loaders)  # type: ignore[no-any-return]


@contextlib.contextmanager
def stop_is_an_error(where: str) -> Iterator[None]:
    """Turn a ``StopTraining`` raised where there is no training to stop into an error."""
    try:
        yield
    except StopTraining as stop:
        raise RuntimeError(
            f"StopTraining was raised {where}, where it cannot stop anything: raise it only "
            f"from the hooks that run while training (pre_fit to post_epoch): {stop}"
        ) from stop


def check_result(result: Any, step_name: str) -> dict[str, Any]:
    """A step's result as a dict.

    Raises:
        TypeError: if it is not a mapping.
    """
    if isinstance(result, dict):  # the usual result, checked before the slower Mapping
        return result
    if not isinstance(result, Mapping):
        raise TypeError(
            f"{step_name} must return a dict of values (for example {{'loss': loss}}), "
            f"got {type(result).__name__}"
        )
    return dict(result)
