"""Running a user's trainer for a command: its side effects kept out of the user's run."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch.distributed as dist
from typing_extensions import override

from dream_trainer.configs.base import ConfigModel
from dream_trainer.configs.checkpoint import CheckpointParameters
from dream_trainer.configs.logging import LoggingParameters
from dream_trainer.configs.training import TrainingParameters
from dream_trainer.trainer.base import BaseTrainer
from dream_trainer.trainer.callback import Callback
from dream_trainer.trainer.callback_collection import CallbackCollection
from dream_trainer.trainer.lifetime import torn_down
from dream_trainer.world.materialization import Materialization


class Sandbox(Callback[BaseTrainer]):
    """Point the trainer's checkpoints at a temporary directory and turn its logging off.

    At ``pre_configure``, once the process group exists, rank 0 creates the directory and
    every rank receives its name, so that a multi-rank checkpoint lands in one place (a
    simulated rank creates its own). The trainer's config is replaced (``replace_config``) by
    a copy in which every ``CheckpointParameters`` field
    writes there, with no periodic saves and no resume (and no checkpoint at all on a
    simulated rank), every ``LoggingParameters`` field is
    disabled (no local files, no wandb run), and ``TrainingParameters`` get ``training``.
    Nothing the trainer does then reaches the directories the user configured.

    Args:
        training: ``TrainingParameters`` fields to replace (``max_steps``, ...).
    """

    def __init__(self, **training: Any) -> None:
        self.training = training
        self.directory: Path | None = None

    @override
    def pre_configure(self) -> None:
        world = self.trainer.world
        # A simulated rank is alone in its process: the fake backend would broadcast nothing.
        holder = [tempfile.mkdtemp(prefix="dream-trainer-")
                  if world.is_rank_zero or world.simulated else None]
        if world.world_size > 1 and not world.simulated:
            dist.broadcast_object_list(holder, src=0)
        self.directory = Path(holder[0])  # type: ignore[arg-type]
        self.trainer.replace_config(_redirected(self.trainer.config, self.directory,
                                                self.training, world.simulated))


def _redirected(config: Any, directory: Path, training: dict[str, Any],
                simulated: bool) -> Any:
    updates: dict[str, ConfigModel] = {}
    for name in type(config).model_fields:
        value = getattr(config, name)
        if isinstance(value, CheckpointParameters):
            # A simulated rank writes no checkpoint: its process group moves no data, so the
            # ranks could not agree on a directory lock or on what they wrote.
            updates[name] = value.model_copy(update={
                "root_dir": directory, "every_n_steps": None, "every_n_epochs": None,
                "keep_top_k": None, "resume": None, "load_weights_only": False,
                "enabled": value.enabled and not simulated})
        elif isinstance(value, LoggingParameters):
            updates[name] = value.model_copy(update={"enabled": False, "log_dir": directory})
        elif isinstance(value, TrainingParameters) and training:
            updates[name] = value.model_copy(update=training)
    return config.model_copy(update=updates)


def attach(trainer: BaseTrainer, *callbacks: Callback[Any]) -> None:
    """Add callbacks after the user's ones (the collection is the trainer's own copy)."""
    for callback in callbacks:
        trainer.callbacks.append(callback)
    trainer.callbacks.attach(trainer)


@contextmanager
def sandboxed(trainer: BaseTrainer, **training: Any) -> Iterator[Sandbox]:
    """Attach a ``Sandbox`` for the duration of the block, then delete its directory."""
    sandbox = Sandbox(**training)
    attach(trainer, sandbox)
    try:
        yield sandbox
    finally:
        if sandbox.directory is not None:
            shutil.rmtree(sandbox.directory, ignore_errors=True)


def train_steps(trainer: BaseTrainer, steps: int, *callbacks: Callback[Any]) -> None:
    """``fit()`` for exactly ``steps`` optimizer steps in the sandbox, with ``callbacks``
    added, over as many epochs as they take."""
    # n_epochs=None, not a count: it is what a stream without a length (and no
    # train_steps_per_epoch) needs to plan its one epoch of max_steps, and on any other loader
    # it runs epochs until max_steps, however few steps the data gives each.
    with sandboxed(trainer, max_steps=steps, n_epochs=None):
        attach(trainer, *callbacks)
        trainer.fit()


@contextmanager
def set_up(trainer: BaseTrainer,
           materialization: Materialization | None = None) -> Iterator[None]:
    """``trainer.set_up(materialization)`` for the duration of the block.

    The process group is torn down afterwards exactly as ``fit()`` tears it down, also when
    ``set_up()`` or the block raises.
    """
    with torn_down(trainer):
        trainer.set_up(materialization)
        yield


def without_callbacks_or_compilation(trainer: BaseTrainer) -> None:
    """Replace the trainer's config by a copy with no callbacks and ``compile_model=False``.

    For a tool that runs a step outside of ``fit()`` and needs the blocks eager; each caller
    says why it needs both.
    """
    device = trainer.config.device_parameters
    trainer.replace_config(trainer.config.model_copy(update={
        "callbacks": CallbackCollection(),
        "device_parameters": device.model_copy(update={"compile_model": False})}))
