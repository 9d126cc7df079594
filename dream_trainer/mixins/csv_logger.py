"""``CSVLoggerMixin``: one CSV file, one column per key, readable by any spreadsheet."""

from __future__ import annotations

import csv
import io
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO, Any

import torch

from dream_trainer.configs.logging import LoggingConfigMixin
from dream_trainer.mixins.logging import LoggerMixin
from dream_trainer.utils.media import (Histogram, ImagesLike, MediaFiles, to_uint8_images,
                                       to_uint8_video)
from dream_trainer.utils.files import append_text, make_dirs, read_text, write_atomically
from dream_trainer.utils.resumed_log import Continuation


class CSVLoggerConfigMixin(LoggingConfigMixin):
    """``logging_parameters`` for ``CSVLoggerMixin`` (the file is
    ``<log_dir>/.../logs/metrics.csv``)."""


class CSVLoggerMixin(LoggerMixin):
    """Logs to ``<log_dir>/<project>/<group>/<experiment>/logs/metrics.csv``: a ``step``
    column, then one column per key in the order keys first appeared, one row per log call
    (empty cells for the keys it did not log).

    A key first seen after rows were written (validation's, say) adds a column: the file is
    rewritten with the wider header into a temporary file that then replaces it, so it is
    never left half-written. A run resumed from the checkpoint of step S reads the header
    back, drops the rows the interrupted run wrote after that checkpoint (those past S, and at
    S the keys it logs again: see ``dream_trainer.utils.resumed_log``) and appends, so that
    the file holds one value per step and key. Images, videos,
    histograms and tables are written under ``logs/media/`` (see ``JSONLoggerMixin``) and
    their cell holds the path relative to ``logs/`` (images: the paths joined by ``;``);
    text goes in its cell.
    """

    config_mixin = CSVLoggerConfigMixin

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._csv_file: IO[str] | None = None
        self._csv_columns: list[str] = []
        self._csv_media: MediaFiles | None = None
        self._csv_continuation: Continuation | None = None

    @property
    def csv_path(self) -> Path:
        """``log_dir / "metrics.csv"``."""
        return self.log_dir / "metrics.csv"

    def start_logging(self) -> None:
        super().start_logging()
        # A link planted as the folder (or one of the run's above it) or the file is
        # refused: whoever can write the run's folder could redirect the log through it.
        make_dirs(self.log_dir, root=self.logging_parameters.log_dir)
        self._csv_columns = ["step"]
        if os.path.lexists(self.csv_path) and self.csv_path.lstat().st_size:
            with read_text(self.csv_path, newline="") as existing:
                self._csv_columns = next(csv.reader(existing), None) or ["step"]
            if self.global_step > 0:  # resumed: start_logging runs after the checkpoint loads
                self._csv_continuation = Continuation.resume(
                    self.csv_path, self.global_step, self._csv_rows(), self._rewrite)
        else:
            write_atomically(self.csv_path, (",".join(self._csv_columns) + "\n").encode())
        self._csv_file = append_text(self.csv_path, newline="")
        self._csv_media = MediaFiles(self.log_dir)

    def log_dict(self, values: Mapping[str, float], step: int | None = None) -> None:
        super().log_dict(values, step)
        self._write_row(values, step)

    def log_images(self, key: str, images: ImagesLike,
                   captions: Sequence[str] | None = None) -> None:
        super().log_images(key, images, captions)
        if self._csv_media is not None:
            paths = self._csv_media.images(key, self.global_step, to_uint8_images(images))
            self._write_row({key: ";".join(paths)})

    def log_video(self, key: str, frames: torch.Tensor, fps: float) -> None:
        super().log_video(key, frames, fps)
        if self._csv_media is not None:
            self._write_row({key: self._csv_media.video(key, self.global_step,
                                                        to_uint8_video(frames), fps)})

    def log_histogram(self, key: str, values: torch.Tensor) -> None:
        super().log_histogram(key, values)
        if self._csv_media is not None:
            histogram = Histogram.from_values(values, self.logging_parameters.histogram_bins)
            self._write_row({key: self._csv_media.histogram(key, self.global_step, histogram)})

    def log_table(self, key: str, columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
        super().log_table(key, columns, rows)
        if self._csv_media is not None:
            self._write_row({key: self._csv_media.table(key, self.global_step, columns, rows)})

    def log_text(self, key: str, text: str) -> None:
        super().log_text(key, text)
        self._write_row({key: text})

    def finish(self) -> None:
        super().finish()
        if self._csv_file is not None:
            self._csv_file.close()
            self._csv_file = None
            self._csv_media = None

    def _write_row(self, values: Mapping[str, Any], step: int | None = None) -> None:
        if self._csv_file is None:
            return
        step = self.global_step if step is None else step
        new = [key for key in values if key not in self._csv_columns]
        if new:
            self._csv_columns += new
            self._rewrite(self._csv_rows())  # the wider header, old rows' new cells empty
        if self._csv_continuation is not None and not self._csv_continuation.settle(
                step, values, self._csv_rows, self._rewrite):
            self._csv_continuation = None
        csv.DictWriter(self._csv_file, self._csv_columns).writerow({"step": step, **values})
        self._csv_file.flush()

    def _csv_rows(self) -> list[dict[str, Any]]:
        if self._csv_file is not None:
            self._csv_file.flush()
        with read_text(self.csv_path, newline="") as file:
            return list(csv.DictReader(file))

    def _rewrite(self, rows: list[dict[str, Any]]) -> None:
        """Replace the file by the current header and ``rows`` through a temporary file, so
        that it is never left half-written; the appending handle, if open, follows."""
        text = io.StringIO(newline="")
        # A row with more cells than the header (a damaged file) has the extras under the key
        # None: they go.
        writer = csv.DictWriter(text, self._csv_columns, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
        write_atomically(self.csv_path, text.getvalue().encode())
        if self._csv_file is not None:
            self._csv_file.close()
            self._csv_file = append_text(self.csv_path, newline="")
