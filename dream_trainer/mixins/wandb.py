"""``WandBLoggerMixin``: Weights & Biases logging, offline by default."""

from __future__ import annotations

import io
import uuid
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import torch
from pydantic import Field

from dream_trainer.configs.logging import LoggingConfigMixin
from dream_trainer.mixins.logging import LoggerMixin
from dream_trainer.trainer.phases import runs_on
from dream_trainer.utils.media import (Histogram, ImagesLike, plain, to_uint8_images,
                                       to_uint8_video)
from dream_trainer.world.agree import from_rank_zero


def _wandb() -> Any:
    try:
        import wandb
    except ImportError as exc:
        raise ImportError(
            "WandBLoggerMixin needs wandb: pip install 'dream-trainer[wandb]'"
        ) from exc
    return wandb


def _encode_gif(frames: torch.Tensor, fps: float) -> bytes:
    """Uint8 ``(T, H, W, C)`` frames as a looping GIF (the one animation format wandb takes
    from memory without moviepy)."""
    try:
        from PIL import Image
    except ImportError as exc:
        raise ImportError("WandBLoggerMixin.log_video needs pillow: pip install "
                          "'dream-trainer[wandb]'") from exc
    arrays = [frame.squeeze(-1).numpy() if frame.shape[-1] == 1 else frame.numpy()
              for frame in frames]
    images = [Image.fromarray(array) for array in arrays]
    buffer = io.BytesIO()
    images[0].save(buffer, format="GIF", save_all=True, append_images=images[1:],
                   duration=max(1, round(1000 / fps)), loop=0)
    return buffer.getvalue()


class WandBLoggerConfigMixin(LoggingConfigMixin):
    """Adds ``logging_parameters`` and the wandb run settings (wandb writes under
    ``<log_dir>/.../logs/wandb``)."""

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
    and its steps keep increasing. Media use wandb's types at the current ``global_step``:
    ``wandb.Image`` (with its caption) per image, ``wandb.Video`` (a GIF), ``wandb.Histogram``
    (the bins of ``log_histogram``), ``wandb.Table``, and a one-column ``wandb.Table`` for text.
    Images and videos need pillow, which the ``wandb`` extra installs.
    """

    config_mixin = WandBLoggerConfigMixin

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.wandb_run: Any = None
        self._wandb_run_id: str | None = None

    @runs_on("post_setup")
    def _agree_on_run_id(self) -> None:
        # Every rank holds the id, since any rank's copy may be the one a checkpoint keeps. A
        # resume (CheckpointMixin, listed before this mixin) has already restored it.
        self._wandb_run_id = from_rank_zero(self._wandb_run_id or uuid.uuid4().hex[:8])

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

    def log_images(self, key: str, images: ImagesLike,
                   captions: Sequence[str] | None = None) -> None:
        super().log_images(key, images, captions)
        if self.wandb_run is not None:
            wandb = _wandb()
            pixels = to_uint8_images(images)
            names = list(captions) if captions else [None] * len(pixels)
            self._log_media(key, [wandb.Image(image.squeeze(-1).numpy() if image.shape[-1] == 1
                                              else image.numpy(), caption=caption)
                                  for image, caption in zip(pixels, names)])

    def log_video(self, key: str, frames: torch.Tensor, fps: float) -> None:
        super().log_video(key, frames, fps)
        if self.wandb_run is not None:
            gif = _encode_gif(to_uint8_video(frames), fps)
            self._log_media(key, _wandb().Video(io.BytesIO(gif), format="gif"))

    def log_histogram(self, key: str, values: torch.Tensor) -> None:
        super().log_histogram(key, values)
        if self.wandb_run is not None:
            histogram = Histogram.from_values(values, self.logging_parameters.histogram_bins)
            self._log_media(key, _wandb().Histogram(
                np_histogram=(histogram.counts, histogram.edges)))

    def log_table(self, key: str, columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
        super().log_table(key, columns, rows)
        if self.wandb_run is not None:
            self._log_media(key, _wandb().Table(
                columns=list(columns), data=[[plain(value) for value in row] for row in rows]))

    def log_text(self, key: str, text: str) -> None:
        super().log_text(key, text)
        if self.wandb_run is not None:
            self._log_media(key, _wandb().Table(columns=["text"], data=[[text]]))

    def _log_media(self, key: str, value: Any) -> None:
        self.wandb_run.log({key: value}, step=self.global_step)

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
