"""``MediaLogger``: a grid of the images or videos that validation produces, once per pass."""

from __future__ import annotations

import math
from typing import Any

import torch
from typing_extensions import override

from dream_trainer.mixins.logging import LoggerMixin
from dream_trainer.trainer.callback import RankZeroCallback
from dream_trainer.utils.media import make_grid, to_uint8_images, to_uint8_video


class MediaLogger(RankZeroCallback[LoggerMixin]):
    """Log the first ``max_samples`` images (or videos) that ``validation_step`` returns under
    ``key`` as one grid, once per validation pass, on global rank 0.

    ``result[key]`` is a batch of images ``(B, C, H, W)`` (or ``(B, H, W)`` gray) or of videos
    ``(B, T, C, H, W)``, floats in [0, 1] (clamped) or uint8. Samples are taken in order from
    rank 0's batches until ``max_samples`` are held (copied to the CPU); at the end of the pass
    they are tiled, ``nrow`` to a row, and logged with ``trainer.log_images`` (one grid image)
    or ``trainer.log_video`` (a video whose frames are grids) at the current ``global_step``.
    The sanity check is not logged. Non-scalar values are ignored by the epoch averages, so
    returning them costs nothing else.

    Args:
        key: The key of ``validation_step``'s result that holds the samples.
        max_samples: At most this many samples in the grid.
        nrow: Samples per row of the grid; ``ceil(sqrt(max_samples))`` when None.
        fps: Frames per second of logged videos.
        name: The key to log under; ``key`` when None.

    Raises:
        ValueError: if ``max_samples < 1``, ``nrow < 1`` or ``fps <= 0``.
    """

    trainer: LoggerMixin

    def __init__(self, key: str, max_samples: int = 16, nrow: int | None = None,
                 fps: float = 8.0, name: str | None = None) -> None:
        if max_samples < 1:
            raise ValueError(f"MediaLogger max_samples must be at least 1, got {max_samples}")
        if nrow is not None and nrow < 1:
            raise ValueError(f"MediaLogger nrow must be at least 1 (or None), got {nrow}")
        if not fps > 0:
            raise ValueError(f"MediaLogger fps must be positive, got {fps}")
        self.key = key
        self.max_samples = max_samples
        self.nrow = nrow if nrow is not None else math.ceil(math.sqrt(max_samples))
        self.fps = fps
        self.name = name if name is not None else key
        self._samples: list[torch.Tensor] = []
        self._held = 0

    @override
    def pre_val_epoch(self) -> None:
        self._samples, self._held = [], 0

    @override
    def post_val_batch(self, result: dict[str, Any], batch_idx: int) -> None:
        if self.trainer.sanity_checking or self._held >= self.max_samples:
            return
        value = result.get(self.key)
        if value is None:
            return
        if not isinstance(value, torch.Tensor) or value.dim() not in (3, 4, 5):
            shape = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
            raise ValueError(
                f"MediaLogger: validation_step's {self.key!r} must be a batch of images "
                f"(B, C, H, W) or (B, H, W), or of videos (B, T, C, H, W); got {shape}")
        taken = value[: self.max_samples - self._held].detach().cpu()
        self._samples.append(taken)
        self._held += len(taken)

    @override
    def post_val_epoch(self, result: dict[str, Any]) -> None:
        if not self._samples:
            return
        samples = torch.cat(self._samples)
        self._samples, self._held = [], 0
        if samples.dim() == 5:
            frames = torch.stack([to_uint8_video(sample) for sample in samples], dim=1)
            grids = torch.stack([make_grid(frame, self.nrow) for frame in frames])
            self.trainer.log_video(self.name, grids.permute(0, 3, 1, 2), self.fps)
        else:
            grid = make_grid(to_uint8_images(samples if samples.dim() == 4
                                             else samples.unsqueeze(1)), self.nrow)
            self.trainer.log_images(self.name, grid.permute(2, 0, 1))
