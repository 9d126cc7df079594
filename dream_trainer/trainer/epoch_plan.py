"""How many optimizer steps an epoch has: read off the train loader, checked, and agreed by
every rank (ranks with different loader lengths would otherwise wait forever in a collective)."""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

from dream_trainer.configs.training import TrainingParameters
from dream_trainer.world.agree import agree_min
from dream_trainer.world.world import DistributedWorld

logger = logging.getLogger(__name__)


def plan_train_steps(loader: Iterable[Any], params: TrainingParameters,
                     world: DistributedWorld) -> int:
    """Optimizer steps per epoch, checked against the train loader and agreed by every rank.

    Raises:
        ValueError: for an empty loader, one without a length and no step count to use
            instead, or one with fewer batches than one accumulation window.
    """
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
        if params.train_steps_per_epoch is not None:
            steps = params.train_steps_per_epoch
        elif params.n_epochs is None and params.max_steps is not None:
            steps = params.max_steps  # one epoch reaches the step budget
        else:
            raise ValueError(
                "the train dataloader has no length (an iterable dataset): set "
                "training_parameters.train_steps_per_epoch, or n_epochs=None with "
                "max_steps to train on the stream until the step budget"
            )
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
    agreed = agree_min(steps, world.device)
    if agreed != steps:
        logger.warning(
            "rank %d has %d optimizer steps per epoch but another rank has only %d: every "
            "rank runs %d (give every rank the same amount of data)",
            world.rank, steps, agreed, agreed,
        )
    return agreed
