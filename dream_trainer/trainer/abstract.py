"""``AbstractTrainer``: the interface every trainer and mixin builds on."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
from pydantic import Field, ValidationInfo, field_validator
from torch import nn
from torch.optim.lr_scheduler import LRScheduler

from dream_trainer.configs.base import ConfigModel
from dream_trainer.configs.device import DeviceParameters
from dream_trainer.errors import StopTraining
from dream_trainer.parallel.layout import Layout
from dream_trainer.trainer.history import History
from dream_trainer.trainer.hooks import TrainerHooks
from dream_trainer.trainer.phases import chain_base, run_phase_to_the_end
from dream_trainer.utils.paths import component_problem
from dream_trainer.world.world import DistributedWorld

__all__ = ["AbstractTrainer", "AbstractTrainerConfig", "StopTraining"]


class AbstractTrainerConfig(ConfigModel):
    """Identity of a run and where it runs.

    ``project``/``group``/``experiment`` name the run in logs and checkpoint paths.
    """

    project: str = Field(min_length=1)
    """Project name (top level of logs and checkpoints)."""
    group: str = Field(min_length=1)
    """Group of related experiments within the project."""
    experiment: str = Field(min_length=1)
    """This run's name within the group."""
    seed: int | None = 42
    """Seed for python, numpy and torch on every rank, from -2**63 to 2**63 - 1; ``None``
    leaves them unseeded."""
    device_parameters: DeviceParameters = Field(default_factory=DeviceParameters)
    """Mesh, precision and device; by default data parallel over every launched rank."""

    @field_validator("project", "group", "experiment")
    @classmethod
    def _one_directory_name(cls, name: str, info: ValidationInfo) -> str:
        # Each name is one directory of <root>/<project>/<group>/<experiment>: an absolute
        # name or ".." would put the run's checkpoints and logs outside the root.
        problem = component_problem(name)
        if problem is not None:
            raise ValueError(
                f"{info.field_name}={name!r} {problem}: it names one directory of the run's "
                "path <root_dir>/<project>/<group>/<experiment>, so it must be a plain name "
                "without '/', '\\', NUL, '.' or '..'; choose the directory with root_dir")
        return name

    @field_validator("seed")
    @classmethod
    def _seedable(cls, seed: int | None) -> int | None:
        # torch takes seeds of 64 bits; a sampler seeds torch with seed + epoch, so the
        # signed range leaves room above it.
        if seed is not None and not -2**63 <= seed < 2**63:
            raise ValueError(f"seed={seed} is outside the range every generator accepts, "
                             "-2**63 to 2**63 - 1: choose a seed in it")
        return seed

    def run_dir(self, root: str | Path) -> Path:
        """``<root>/<project>/<group>/<experiment>``: where this run keeps its files under
        ``root`` (checkpoints and logs each have their own root)."""
        return Path(root) / self.project / self.group / self.experiment


class AbstractTrainer(TrainerHooks, ABC):
    """The contract between the loop, the mixins and user code.

    The hook methods inherited from ``TrainerHooks`` are no-ops here, left to users: an
    override need not call ``super()``. Mixins do their own work at those points in methods
    marked ``@runs_on(hook)`` (``dream_trainer.trainer.phases``), which the trainer runs
    before the public hook whatever an override does.
    """

    # ``callbacks`` is declared by the loop's parts that use it (``HookDispatch``,
    # ``LoopState``): a callback is typed against this interface, so it names no callback type.
    config: AbstractTrainerConfig
    world: DistributedWorld
    layout: Layout
    """What differs between one process, data parallel, a pipeline and expert parallelism,
    resolved once from ``world.dims``: the loop and the mixins call it, never branch on it."""
    training: bool
    sanity_checking: bool
    evaluating: bool
    global_step: int
    local_batches: int
    current_epoch: int

    @property
    @abstractmethod
    def is_accumulating_gradients(self) -> bool:
        """True on every micro-batch of an accumulation window but the last."""

    # -- phases --------------------------------------------------------------------------
    @abstractmethod
    def fit(self) -> History:
        """Run the whole lifecycle: launch, configure, setup, train, teardown; return the
        run's history."""

    @abstractmethod
    def build_models(self) -> None:
        """The configure phase: create the models (on the meta device, without storage)."""

    @abstractmethod
    def build_training(self) -> None:
        """The setup phase: parallelize and materialize the models; create the optimizers,
        schedulers and loaders."""

    def end_of_step(self) -> None:
        """After every hook of an optimizer step's last micro-batch has run (callbacks'
        ``post_train_batch`` included): where state that must reflect the whole step, such as
        a checkpoint, is taken, after the mixins' ``@runs_on("end_of_step")`` work. A user
        hook: overrides need not call ``super()``.
        """

    def end_of_validation_set(self, result: dict[str, Any]) -> None:
        """After the batches of each validation set (each set of a pass over several), with
        that set's averaged results: mixins add what they computed over the set (metrics) to
        ``result``, which is then prefixed with the set's name. Mixins do so in
        ``@runs_on("end_of_validation_set")`` methods; overrides need not call ``super()``.
        """

    @chain_base
    def teardown(self) -> None:
        """Release what holds the process group, before ``fit()`` destroys it (always runs).

        Runs every mixin's ``@runs_on("teardown")`` work (each even if another fails).
        Overrides call ``super().teardown()``; one that does not is detected by ``fit()``,
        which then runs this part after it (see ``call_through``).
        """
        run_phase_to_the_end(self, "teardown")

    # -- what the trainer owns -------------------------------------------------------------
    @abstractmethod
    def named_models(self) -> dict[str, nn.Module]:
        """The models, by attribute name (wrapped by DDP/FSDP where that applies)."""

    @abstractmethod
    def named_optimizers(self) -> dict[str, torch.optim.Optimizer]:
        """The optimizers, by attribute name."""

    @abstractmethod
    def named_schedulers(self) -> dict[str, LRScheduler]:
        """The learning-rate schedulers, by attribute name."""

    @property
    @abstractmethod
    def train_dataloader(self) -> Iterable[Any]:
        """The training data loader."""

    @property
    @abstractmethod
    def val_dataloader(self) -> Iterable[Any] | Mapping[str, Iterable[Any]] | None:
        """The validation data loader, ``{name: loader}`` for several sets, or None."""

    # -- user steps --------------------------------------------------------------------------
    @abstractmethod
    def training_step(self, batch: Any, batch_idx: int) -> dict[str, Any]:
        """Forward, ``self.backward(loss)`` and, at the end of a window, ``self.step(...)``."""

    @abstractmethod
    def validation_step(self, batch: Any, batch_idx: int) -> dict[str, Any]:
        """Compute validation values for one batch (gradients are disabled)."""

    @abstractmethod
    def evaluate(self, dataloader: Iterable[Any] | Mapping[str, Iterable[Any]] | None = None,
                 max_batches: int | None = None) -> dict[str, float]:
        """Run one validation pass now and return its averaged results."""

    @abstractmethod
    def reduce_step_result(self) -> dict[str, float]:
        """The current optimizer step's results over its micro-batches and data-parallel
        ranks (a collective; see ``BaseTrainer``)."""

    # -- state -----------------------------------------------------------------------------
    @abstractmethod
    def state_dict(self) -> dict[str, Any]:
        """The trainer's own resumable state (counters and callback states)."""

    @abstractmethod
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore what ``state_dict`` returned."""

    @chain_base
    def extra_state_dict(self) -> dict[str, Any]:
        """State of the trainer or its mixins that checkpoints must keep (a logger's run id,
        a counter), the same on every rank: saved once, restored to every rank.

        Tensors, builtin containers and scalars, in any structure (a class of your own once
        listed in ``checkpoint_parameters.trusted_globals``); it comes back exactly as saved.
        A mixin that overrides this merges its entries into ``super().extra_state_dict()``.
        """
        return {}

    @chain_base
    def load_extra_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore what ``extra_state_dict`` returned; overrides call ``super()``.

        ``state_dict`` is exactly what was saved, whatever its shape: a key that the saved
        run did not have is missing here, so read keys with a default.
        """

    def data_state_dict(self) -> Any | None:
        """This rank's position in a stateful train loader, or None (see ``BaseTrainer``)."""
        return None

    def load_data_state_dict(self, states: Mapping[int, Any], saved_dp_size: int) -> None:
        """Restore the train loader's position from every saved data-parallel rank's."""

    @chain_base
    def rank_state_dict(self) -> dict[str, Any]:
        """State that differs between processes (an RNN's hidden state, a per-rank buffer):
        saved for every process and restored to the same one.

        ``extra_state_dict`` is saved once and must be equal on every rank (a save refuses
        state that is not); this is its per-process counterpart. A resume with another
        number of processes cannot give each one its own state back, and is refused when
        there is any. Overrides merge into ``super().rank_state_dict()``.
        """
        return {}

    @chain_base
    def load_rank_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore what ``rank_state_dict`` returned on this process; overrides call
        ``super()``."""
