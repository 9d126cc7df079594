"""Learning-rate schedulers stepped by a metric (``ReduceLROnPlateau``) rather than by steps,
and the number of optimizer steps a run plans (what step-driven schedules span)."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Mapping
from typing import Any

from torch.optim.lr_scheduler import LRScheduler

from dream_trainer.configs.training import TrainingParameters


def takes_metric(scheduler: LRScheduler) -> bool:
    """True when ``scheduler.step`` needs a value (``ReduceLROnPlateau.step(metrics)``)."""
    step = scheduler.step
    function = getattr(step, "__func__", None)
    # step() asks at every optimizer step: the signature is read once per step function.
    return _needs_value(step, bound=False) if function is None \
        else _needs_value(function, bound=True)


@functools.cache
def _needs_value(step: Callable[..., Any], bound: bool) -> bool:
    """Whether ``step``'s first argument (after ``self`` when ``bound``) is required."""
    parameters = list(inspect.signature(step).parameters.values())[1 if bound else 0:]
    return bool(parameters) and parameters[0].default is inspect.Parameter.empty \
        and parameters[0].kind in (inspect.Parameter.POSITIONAL_ONLY,
                                   inspect.Parameter.POSITIONAL_OR_KEYWORD)


def step_with_metric(schedulers: Mapping[str, LRScheduler], monitor: str | None,
                     result: Mapping[str, Any], where: str) -> None:
    """Step every metric-driven scheduler with ``result[monitor]``.

    Raises:
        ValueError: if a scheduler needs a metric and ``result`` lacks ``monitor``.
    """
    metric_driven = {name: s for name, s in schedulers.items() if takes_metric(s)}
    if not metric_driven:
        return
    if monitor not in result:
        raise ValueError(
            f"scheduler_monitor={monitor!r} is not in the {where} results, which "
            f"{', '.join(sorted(metric_driven))} steps on; available keys: {sorted(result)}"
        )
    value = float(result[monitor])
    for scheduler in metric_driven.values():
        scheduler.step(value)  # type: ignore[call-arg]


def planned_optimizer_steps(params: TrainingParameters, steps_per_epoch: int) -> int:
    """Optimizer steps ``fit()`` runs in all: every epoch's, cut at ``max_steps``.

    Args:
        params: The run's training parameters.
        steps_per_epoch: Optimizer steps per epoch, as the trainer planned them.

    Returns:
        The planned number of optimizer steps over the whole run.
    """
    if params.n_epochs is None:  # validated: max_steps is set
        return int(params.max_steps)  # type: ignore[arg-type]
    total = params.n_epochs * steps_per_epoch
    return total if params.max_steps is None else min(total, params.max_steps)
