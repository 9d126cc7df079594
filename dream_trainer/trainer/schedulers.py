"""Learning-rate schedulers stepped by a metric (``ReduceLROnPlateau``) rather than by steps."""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

from torch.optim.lr_scheduler import LRScheduler


def takes_metric(scheduler: LRScheduler) -> bool:
    """True when ``scheduler.step`` needs a value (``ReduceLROnPlateau.step(metrics)``)."""
    parameters = list(inspect.signature(scheduler.step).parameters.values())
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
