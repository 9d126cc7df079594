"""``WandBLoggerMixin``: Weights & Biases logging, offline by default."""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from typing import Any, Literal

import torch.distributed as dist
from pydantic import Field

from dream_trainer.configs.base import ConfigModel
from dream_trainer.configs.logging import LoggingParameters
from dream_trainer.mixins.logging import LoggerMixin


def _wandb() -> Any:
    try:
        import wandb
    except ImportError as exc:
        raise ImportError(
            "WandBLoggerMixin needs wandb: pip install 'dream-trainer[wandb]'"
        ) from exc
    return wandb


class WandBLoggerConfigMixin(ConfigModel):
    """Adds ``logging_parameters`` and the wandb run settings."""

    logging_parameters: LoggingParameters = Field(default_factory=LoggingParameters)
    """Logging cadence and location (wandb writes under ``<log_dir>/.../logs/wandb``)."""
    wandb_mode: Literal["online", "offline", "disabled"] = "offline"
    """``offline`` needs no account or network; sync later with ``wandb sync``."""
    wandb_entity: str | None = None
    """The wandb team or user (online mode)."""
    wandb_tags: list[str] = Field(default_factory=list)
    """Tags attached to the run."""


class WandBLoggerMixin(LoggerMixin):
    """Logs to a wandb run named after the experiment, in the project and group of the config.

    ``wandb.init`` runs at the end of setup on rank 0, never at construction. The run id is
    saved in checkpoints and reused on resume, so a resumed run continues the same wandb run
    and its steps keep increasing.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.wandb_run: Any = None
        self._wandb_run_id: str | None = None

    def post_setup(self) -> None:
        # Every rank holds the id, since any rank's copy may be the one a checkpoint keeps. A
        # resume (CheckpointMixin, listed before this mixin) has already restored it.
        holder = [self._wandb_run_id or uuid.uuid4().hex[:8]]
        if self.world.world_size > 1:
            dist.broadcast_object_list(holder, src=0)
        self._wandb_run_id = holder[0]
        super().post_setup()

    def start_logging(self) -> None:
        super().start_logging()
        wandb = _wandb()
        config = self.config
        (self.log_dir / "wandb").mkdir(parents=True, exist_ok=True)
        self.wandb_run = wandb.init(
            project=config.project, group=config.group, name=config.experiment,
            id=self._wandb_run_id, resume="allow",
            mode=config.wandb_mode,  # type: ignore[attr-defined]
            entity=config.wandb_entity,  # type: ignore[attr-defined]
            tags=config.wandb_tags,  # type: ignore[attr-defined]
            dir=str(self.log_dir), reinit="finish_previous",
        )

    def log_dict(self, values: Mapping[str, float], step: int | None = None) -> None:
        super().log_dict(values, step)
        if self.wandb_run is not None:
            self.wandb_run.log(dict(values), step=self.global_step if step is None else step)

    def log_config(self, config: dict[str, Any]) -> None:
        super().log_config(config)
        if self.wandb_run is not None:
            self.wandb_run.config.update(config, allow_val_change=True)

    def finish(self) -> None:
        super().finish()
        if self.wandb_run is not None:
            self.wandb_run.finish()
            self.wandb_run = None

    def extra_state_dict(self) -> dict[str, Any]:
        return {**super().extra_state_dict(), "wandb_run_id": self._wandb_run_id}

    def load_extra_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_extra_state_dict(state_dict)
        self._wandb_run_id = state_dict.get("wandb_run_id") or self._wandb_run_id
