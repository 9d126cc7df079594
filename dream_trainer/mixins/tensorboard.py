"""``TensorBoardLoggerMixin``: TensorBoard event files through ``torch.utils.tensorboard``."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from dream_trainer.configs.logging import LoggingConfigMixin
from dream_trainer.mixins.logging import LoggerMixin
from dream_trainer.utils.media import (Histogram, ImagesLike, encode_apng, encode_png,
                                       markdown_table, to_uint8_images, to_uint8_video)


def _summary_writer() -> Any:
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as exc:
        raise ImportError(
            "TensorBoardLoggerMixin needs tensorboard: pip install 'dream-trainer[tensorboard]'"
        ) from exc
    return SummaryWriter


class TensorBoardLoggerConfigMixin(LoggingConfigMixin):
    """``logging_parameters`` for ``TensorBoardLoggerMixin`` (events go to
    ``<log_dir>/.../logs/tensorboard``)."""


class TensorBoardLoggerMixin(LoggerMixin):
    """Writes TensorBoard event files to ``<log_dir>/<project>/<group>/<experiment>/logs/
    tensorboard/`` (``tensorboard --logdir`` on that folder, or on ``<log_dir>`` for every run).

    Scalars go to the Scalars dashboard; images to the Images dashboard, the images of one call
    as the samples of one step (their captions as text under ``<key>/captions``); a video is an
    animated PNG there; histograms go to the Histograms and Distributions dashboards; tables
    (as markdown) and text to the Text dashboard; the config to the Text dashboard as
    ``config``. A run resumed at step N hides the events the first run wrote after step N
    (``purge_step``), so the curves do not fold back. Needs ``dream-trainer[tensorboard]``.
    """

    config_mixin = TensorBoardLoggerConfigMixin

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.tensorboard_writer: Any = None

    def start_logging(self) -> None:
        super().start_logging()
        summary_writer = _summary_writer()
        # Steps up to the resumed one were logged before its checkpoint was taken.
        purge = self.global_step + 1 if self.global_step > 0 else None
        self.tensorboard_writer = summary_writer(log_dir=str(self.log_dir / "tensorboard"),
                                                 purge_step=purge)

    def log_dict(self, values: Mapping[str, float], step: int | None = None) -> None:
        super().log_dict(values, step)
        if self.tensorboard_writer is not None:
            step = self.global_step if step is None else step
            for key, value in values.items():
                self.tensorboard_writer.add_scalar(key, value, step)

    def log_config(self, config: dict[str, Any]) -> None:
        super().log_config(config)
        if self.tensorboard_writer is not None:
            text = "```json\n" + json.dumps(config, indent=2) + "\n```"
            self.tensorboard_writer.add_text("config", text, self.global_step)

    def log_images(self, key: str, images: ImagesLike,
                   captions: Sequence[str] | None = None) -> None:
        super().log_images(key, images, captions)
        if self.tensorboard_writer is not None:
            pixels = to_uint8_images(images)
            _, height, width, _ = pixels.shape
            self._add_images(key, [encode_png(image) for image in pixels], width, height)
            if captions:
                self.tensorboard_writer.add_text(
                    f"{key}/captions",
                    "\n".join(f"{index}. {caption}" for index, caption in enumerate(captions)),
                    self.global_step)

    def log_video(self, key: str, frames: torch.Tensor, fps: float) -> None:
        super().log_video(key, frames, fps)
        if self.tensorboard_writer is not None:
            pixels = to_uint8_video(frames)
            _, height, width, _ = pixels.shape
            self._add_images(key, [encode_apng(pixels, fps)], width, height)

    def log_histogram(self, key: str, values: torch.Tensor) -> None:
        super().log_histogram(key, values)
        if self.tensorboard_writer is not None:
            histogram = Histogram.from_values(values, self.logging_parameters.histogram_bins)
            # TensorBoard buckets are given by their right edges.
            self.tensorboard_writer.add_histogram_raw(
                key, min=histogram.min, max=histogram.max, num=histogram.num,
                sum=histogram.sum, sum_squares=histogram.sum_squares,
                bucket_limits=histogram.edges[1:], bucket_counts=histogram.counts,
                global_step=self.global_step)

    def log_table(self, key: str, columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
        super().log_table(key, columns, rows)
        if self.tensorboard_writer is not None:
            self.tensorboard_writer.add_text(key, markdown_table(columns, rows), self.global_step)

    def log_text(self, key: str, text: str) -> None:
        super().log_text(key, text)
        if self.tensorboard_writer is not None:
            self.tensorboard_writer.add_text(key, text, self.global_step)

    def finish(self) -> None:
        super().finish()
        if self.tensorboard_writer is not None:
            self.tensorboard_writer.close()
            self.tensorboard_writer = None

    def _add_images(self, key: str, encoded: list[bytes], width: int, height: int) -> None:
        """One image summary in the form of TensorBoard's own image plugin: a string tensor of
        width, height and the encoded images, which the dashboard shows as samples of a step.
        ``SummaryWriter.add_image`` would tile a batch into one picture instead."""
        from tensorboard.compat.proto.summary_pb2 import Summary, SummaryMetadata
        from tensorboard.compat.proto.tensor_pb2 import TensorProto
        from tensorboard.compat.proto.tensor_shape_pb2 import TensorShapeProto

        strings = [str(width).encode(), str(height).encode(), *encoded]
        tensor = TensorProto(dtype=7,  # DT_STRING
                             tensor_shape=TensorShapeProto(
                                 dim=[TensorShapeProto.Dim(size=len(strings))]),
                             string_val=strings)
        metadata = SummaryMetadata(
            plugin_data=SummaryMetadata.PluginData(plugin_name="images"))
        summary = Summary(value=[Summary.Value(tag=key, tensor=tensor, metadata=metadata)])
        self.tensorboard_writer.file_writer.add_summary(summary, self.global_step)
