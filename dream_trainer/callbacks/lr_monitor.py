"""``LRMonitor``: the learning rate of every optimizer's parameter groups, step by step."""

from __future__ import annotations

from typing import Any

from typing_extensions import override

from dream_trainer.mixins.logging import LoggerMixin
from dream_trainer.trainer.callback import RankZeroCallback


class LRMonitor(RankZeroCallback):
    """Record every optimizer's learning rates each ``every_n_steps`` optimizer steps.

    After optimizer step ``N`` (scheduler stepped), the values are those the next update uses,
    as ``scheduler.get_last_lr()`` reports them. They are kept in ``latest`` and ``history`` and
    passed to ``trainer.log_dict(values, step=N)`` when the trainer is a ``LoggerMixin``.
    Keys are ``lr/<optimizer>``, or ``lr/<optimizer>/<group index>`` for several groups.
    Rank 0 only: the learning rates are the same on every rank.

    Args:
        every_n_steps: Record when the global step is a multiple of this. By default, on the
            steps the trainer's logger logs (``log_every_n_steps``, read at each step), and
            every step without a logger: a record is a line written to the log, which every
            step would cost several percent of a small model's step.

    Raises:
        ValueError: if ``every_n_steps < 1``.
    """

    def __init__(self, every_n_steps: int | None = None) -> None:
        if every_n_steps is not None and every_n_steps < 1:
            raise ValueError(f"LRMonitor every_n_steps must be at least 1, got {every_n_steps}")
        self.every_n_steps = every_n_steps
        self.latest: dict[str, float] = {}
        self.history: list[tuple[int, dict[str, float]]] = []
        self._logger: LoggerMixin | None = None

    @override
    def attached(self) -> None:
        self._logger = self.trainer if isinstance(self.trainer, LoggerMixin) else None

    @override
    def post_train_batch(self, result: dict[str, Any], batch_idx: int) -> None:
        # Here rather than in post_optimizer_step: that fires once per optimizer, before the
        # loop counts the step, while this fires once per window with global_step up to date.
        trainer, every = self.trainer, self.every_n_steps
        if every is None:
            every = 1 if self._logger is None else self._logger.logging_parameters.log_every_n_steps
        if trainer.is_accumulating_gradients or trainer.global_step % every:
            return
        self.latest = self.learning_rates()
        self.history.append((trainer.global_step, self.latest))
        if self._logger is not None:
            self._logger.log_dict(dict(self.latest), step=trainer.global_step)

    def learning_rates(self) -> dict[str, float]:
        """The current learning rate of every parameter group of every optimizer.

        Returns:
            ``{"lr/<optimizer>": lr}``, or ``{"lr/<optimizer>/<group index>": lr, ...}`` for an
            optimizer with several parameter groups.
        """
        values: dict[str, float] = {}
        for name, optimizer in self.trainer.named_optimizers().items():
            groups = optimizer.param_groups
            if len(groups) == 1:
                values[f"lr/{name}"] = float(groups[0]["lr"])
                continue
            for index, group in enumerate(groups):
                values[f"lr/{name}/{index}"] = float(group["lr"])
        return values
