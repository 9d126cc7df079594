"""``EvalMixin``: torchmetrics metrics updated in validation, computed across ranks."""

from __future__ import annotations

import math
from typing import Any

import torch

from dream_trainer.configs.base import ConfigModel
from dream_trainer.trainer.abstract import AbstractTrainer
from dream_trainer.trainer.phases import runs_on


def _torchmetrics() -> Any:
    try:
        import torchmetrics
    except ImportError as exc:
        raise ImportError(
            "EvalMixin needs torchmetrics: pip install 'dream-trainer[metrics]'"
        ) from exc
    return torchmetrics


class EvalConfigMixin(ConfigModel):
    """Config counterpart of ``EvalMixin`` (the metrics themselves are code, not config)."""


class EvalMixin(AbstractTrainer):
    """Adds torchmetrics metrics to validation.

    ``configure_metrics()`` assigns ``Metric``/``MetricCollection`` attributes; they are moved
    to the device, reset before every validation pass, updated by ``validation_step`` (call
    ``self.<metric>.update(...)`` or ``self.<metric>(...)``), and at the end of each
    validation set computed over every data-parallel rank, reset, and merged into the result
    as ``"<attribute>/<name>"`` (``"<set>/<attribute>/<name>"`` with several named sets):
    ``<name>`` is a collection's key, or a single metric's class name. A metric that no rank
    updated contributes nothing.
    """

    config_mixin = EvalConfigMixin

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._metric_names: list[str] = []

    def configure_metrics(self) -> None:
        """Assign ``torchmetrics`` metrics to ``self`` (optional)."""

    def named_metrics(self) -> dict[str, Any]:
        """The metrics, by attribute name."""
        return {name: getattr(self, name) for name in self._metric_names}

    # -- phases (run whether or not user hooks call super()) ----------------------------------
    @runs_on("post_setup")
    def _set_up_metrics(self) -> None:
        before = dict(vars(self))
        self.configure_metrics()
        added = [name for name, value in vars(self).items() if before.get(name) is not value]
        if added:
            metric_type = _torchmetrics().Metric, _torchmetrics().MetricCollection
            self._metric_names = [name for name in added
                                  if isinstance(getattr(self, name), metric_type)]
        for metric in self.named_metrics().values():
            metric.to(self.world.device)

    @runs_on("pre_val_epoch")
    def _reset_metrics(self) -> None:
        # The group is looked up for every pass: an evaluation after fit() runs in a process
        # group started for it, and a metric holding fit()'s destroyed group could not sync.
        mesh = self.world.batch_mesh
        for metric in self.named_metrics().values():
            metric.reset()
            for leaf in _leaves(metric):
                # Tensor-parallel ranks see the same samples: sync over the ranks holding
                # different items (data, and context parallel's sequence parts) only, and
                # not at all when there is a single such rank.
                leaf.process_group = None if mesh is None else mesh.get_group()
                leaf.sync_on_compute = mesh is not None
                if mesh is None:
                    # A metric fed with update() keeps the sync decision it was built with
                    # (sync_on_compute takes effect through forward() only), so the sync is
                    # switched off where it is checked; otherwise compute() would gather over
                    # every rank, which under a pipeline only the last stage reaches.
                    leaf.distributed_available_fn = _never

    @runs_on("end_of_validation_set")
    def _add_metrics(self, result: dict[str, Any]) -> None:
        # Each validation set's metrics are computed over its own samples, then reset for
        # the next set; the loop prefixes them with the set's name.
        result.update(self.compute_metrics())

    # -- computing -------------------------------------------------------------------------
    def compute_metrics(self) -> dict[str, float]:
        """Compute every metric over all data-parallel ranks, then reset it (collective).

        Under a pipeline only the ranks holding the last stage see outputs (update metrics
        inside ``loss_fn``): they compute, and every other stage receives their values.
        """
        values: dict[str, float] = {}
        for attribute, metric in self.named_metrics().items():
            updated = any(leaf.update_count > 0 for leaf in _leaves(metric))
            if self.layout.agree_to_compute(updated):
                computed = metric.compute()
                if not isinstance(computed, dict):
                    computed = {type(metric).__name__: computed}
                for name, value in computed.items():
                    values[f"{attribute}/{name}"] = _scalar(value)
            metric.reset()
        return self.layout.share_results(values)


def _never() -> bool:
    return False


def _leaves(metric: Any) -> list[Any]:
    return list(metric.values()) if isinstance(metric, _torchmetrics().MetricCollection) \
        else [metric]


def _scalar(value: Any) -> float:
    if isinstance(value, torch.Tensor):
        return float(value.detach().float().mean()) if value.numel() else math.nan
    return float(value)
