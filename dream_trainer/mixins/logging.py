"""``LoggerMixin``: when and what to log; ``JSONLoggerMixin``: a local backend needing nothing."""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO, Any

import torch

from dream_trainer.configs.logging import LoggingConfigMixin, LoggingParameters
from dream_trainer.trainer.abstract import AbstractTrainer
from dream_trainer.trainer.history import floats
from dream_trainer.trainer.out_of_memory import is_out_of_memory
from dream_trainer.trainer.phases import runs_on
from dream_trainer.utils.media import (Histogram, ImagesLike, MediaFiles, check_images,
                                       check_table, check_video, plain, to_uint8_images,
                                       to_uint8_video)
from dream_trainer.utils.files import append_text, make_dirs, read_text, write_atomically
from dream_trainer.utils.resumed_log import Continuation, Row

logger = logging.getLogger(__name__)

# torch's default for the allocator history: enough to see what filled the memory before an
# out-of-memory error without growing without bound.
MEMORY_HISTORY_ENTRIES = 100_000


class LoggerMixin(AbstractTrainer):
    """The logging cadence, on global rank 0 only, for any number of backends.

    Every ``log_every_n_steps`` optimizer steps the training step's scalar results are logged
    with ``trainer/global_step`` and ``trainer/epoch`` (learning rates come from the
    ``LRMonitor`` callback, which logs through ``log_dict``); epoch results are logged after each training epoch (as
    ``train_epoch/<key>``) and validation pass (under their own keys). Backends override
    ``start_logging``, ``log_dict``, ``log_config``, ``finish`` and the media methods
    (``log_images``, ``log_video``, ``log_histogram``, ``log_table``, ``log_text``) and call
    ``super()`` first, so several backend mixins on one trainer all receive everything. The
    media methods log at the current ``global_step``, on global rank 0 only (other ranks have
    no open run); here they check their arguments, on every rank, and log nothing.
    """

    config_mixin = LoggingConfigMixin


    @property
    def logging_parameters(self) -> LoggingParameters:
        return self.config.logging_parameters  # type: ignore[attr-defined,no-any-return]

    @property
    def log_dir(self) -> Path:
        """``<log_dir>/<project>/<group>/<experiment>/logs``."""
        return self.config.run_dir(self.logging_parameters.log_dir) / "logs"

    @property
    def _logging(self) -> bool:
        return self.logging_parameters.enabled and self.world.is_rank_zero

    # -- backend interface ---------------------------------------------------------------------
    def start_logging(self) -> None:
        """Open the backend's run (rank 0, once, at the end of setup). It runs after a
        checkpoint's resume (``post_setup`` work of ``after_bases=False``, which runs first):
        ``global_step`` is then the step the run continues from."""

    def log_dict(self, values: Mapping[str, float], step: int | None = None) -> None:
        """Record scalar ``values`` at ``step`` (the global step when None). Here: fire the
        ``on_log`` hook, so that every callback sees every logged dict."""
        if self._logging:
            self._fire("on_log", values, self.global_step if step is None else step)

    def log_config(self, config: dict[str, Any]) -> None:
        """Record the run's configuration."""

    def finish(self) -> None:
        """Flush and close the backend's run."""

    # -- media (backends override, calling super() first) ------------------------------------
    def log_images(self, key: str, images: ImagesLike,
                   captions: Sequence[str] | None = None) -> None:
        """Record images under ``key`` at the current ``global_step``.

        Args:
            key: The name to log under.
            images: ``(N, C, H, W)``, ``(C, H, W)``, ``(H, W)`` or a sequence of ``(C, H, W)``
                tensors of one size; floats in [0, 1] (clamped) or uint8; C is 1, 3 or 4.
            captions: One caption per image, or None.

        Raises:
            TypeError, ValueError: if the images or captions do not have that form.
        """
        check_images(images, captions)

    def log_video(self, key: str, frames: torch.Tensor, fps: float) -> None:
        """Record one video, ``(T, C, H, W)`` frames (floats in [0, 1] or uint8), played at
        ``fps`` frames per second.

        Raises:
            TypeError, ValueError: if the frames do not have that form, or ``fps <= 0``.
        """
        check_video(frames, fps)

    def log_histogram(self, key: str, values: torch.Tensor) -> None:
        """Record the distribution of ``values`` (any shape) in
        ``logging_parameters.histogram_bins`` equal-width bins over their finite values.

        Raises:
            TypeError: if ``values`` is not a tensor.
        """
        if not isinstance(values, torch.Tensor):
            raise TypeError(f"log_histogram({key!r}) takes a tensor of values, got "
                            f"{type(values).__name__}: wrap it with torch.as_tensor(...)")

    def log_table(self, key: str, columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
        """Record a table: ``columns`` names and ``rows`` of one value per column.

        Raises:
            ValueError: if a row's length differs from the number of columns.
        """
        check_table(columns, rows)

    def log_text(self, key: str, text: str) -> None:
        """Record a piece of text (markdown where the backend renders it).

        Raises:
            TypeError: if ``text`` is not a string.
        """
        if not isinstance(text, str):
            raise TypeError(f"log_text({key!r}) takes a str, got {type(text).__name__}")

    # -- cadence (phases: user hooks that skip super() do not disable logging) ------------------
    @runs_on("post_setup", after_bases=True)
    def _start_logging_run(self) -> None:
        if self._logging:
            self.start_logging()
            self.log_config(json.loads(self.config.model_dump_json()))

    @runs_on("post_train_batch", after_bases=True)
    def _log_train_step(self, result: dict[str, Any], batch_idx: int) -> None:
        params = self.logging_parameters
        if (not params.enabled or self.is_accumulating_gradients
                or self.global_step % params.log_every_n_steps):
            return
        # On every rank: the step's value is reduced over the ranks (a collective) on the
        # steps that are logged, and only those.
        values = self.reduce_step_result()
        self._record_step(values, self.global_step)
        if not self._logging:
            return
        local = floats(result)
        values.update({key: local[key] for key in params.unreduced_keys if key in local})
        values["trainer/global_step"] = float(self.global_step)
        values["trainer/epoch"] = float(self.current_epoch)
        self.log_dict(values, self.global_step)

    @runs_on("post_train_epoch", after_bases=True)
    def _log_train_epoch(self, result: dict[str, Any]) -> None:
        # A run resumed from its epoch's last step ends that epoch with no batch: no means.
        if self._logging and result:
            self.log_dict({f"train_epoch/{k}": v for k, v in floats(result).items()},
                          self.global_step)

    @runs_on("post_val_epoch", after_bases=True)
    def _log_val_epoch(self, result: dict[str, Any]) -> None:
        if self._logging and not self.sanity_checking:
            self.log_dict(floats(result), self.global_step)

    @runs_on("post_fit", after_bases=True)
    def _finish_after_fit(self) -> None:
        if self._logging:
            self.finish()

    @runs_on("on_exception", after_bases=True)
    def _finish_after_exception(self, exception: BaseException) -> None:
        if self._logging:
            self.finish()

    # -- CUDA memory snapshot of an out-of-memory failure -----------------------------------
    @property
    def _records_memory(self) -> bool:
        return self.logging_parameters.memory_snapshot_on_oom and self.world.device.type == "cuda"

    @runs_on("post_setup")
    def _record_memory_history(self) -> None:
        if self._records_memory:
            torch.cuda.memory._record_memory_history(max_entries=MEMORY_HISTORY_ENTRIES)
        elif self.logging_parameters.memory_snapshot_on_oom:
            logger.warning("logging_parameters.memory_snapshot_on_oom=True, but this run is on "
                           "%s and only CUDA records allocation history: no snapshot will be "
                           "written (set it False off CUDA)", self.world.device)

    @runs_on("on_exception")
    def _dump_memory_snapshot(self, exception: BaseException) -> None:
        if not (self._records_memory and is_out_of_memory(exception)):
            return
        path = self.log_dir / f"memory_snapshot_rank{self.world.rank}.pickle"
        partial = path.with_name(f".{path.name}.partial")
        make_dirs(path.parent)
        # Written beside its final name and renamed: a failure mid-dump leaves no snapshot
        # that looks complete.
        torch.cuda.memory._dump_snapshot(str(partial))
        os.replace(partial, path)
        logger.error("rank %d: the CUDA memory history before this out-of-memory error is in "
                     "%s (open it at https://pytorch.org/memory_viz)", self.world.rank, path)

    @runs_on("teardown")
    def _stop_memory_history(self) -> None:
        if self._records_memory:
            torch.cuda.memory._record_memory_history(enabled=None)


class JSONLoggerConfigMixin(LoggingConfigMixin):
    """``logging_parameters`` for ``JSONLoggerMixin``."""


class JSONLoggerMixin(LoggerMixin):
    """Logs to ``<log_dir>/.../logs/metrics.jsonl``, one ``{"step": N, ...}`` object a line.

    Needs no package or account. A run resumed from the checkpoint of step S drops the
    records the interrupted run wrote after that checkpoint (those past S, and at S the keys
    it logs again: see ``dream_trainer.utils.resumed_log``) and appends, so that the file
    holds one value per step and key. The config is written to ``logs/config.json``. Images
    and videos are PNG and animated PNG files under ``logs/media/``; their record holds
    ``{"_type": "images", "paths": [...], "captions": [...]}`` or ``{"_type": "video",
    "path": ..., "fps": ...}``, paths relative to ``logs/``. Histograms (``"histogram"``:
    ``counts``, ``edges``, ...), tables (``"table"``: ``columns``, ``rows``) and text
    (``"text"``: ``text``) are written in the record itself.
    """

    config_mixin = JSONLoggerConfigMixin

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._json_file: IO[str] | None = None
        self._json_media: MediaFiles | None = None
        self._json_continuation: Continuation | None = None

    @property
    def _json_path(self) -> Path:
        return self.log_dir / "metrics.jsonl"

    def start_logging(self) -> None:
        super().start_logging()
        # A link planted as the folder (or one of the run's above it) or the file is
        # refused: whoever can write the run's folder could redirect the log through it.
        make_dirs(self.log_dir, root=self.logging_parameters.log_dir)
        if self.global_step > 0 and os.path.lexists(self._json_path):
            self._json_continuation = Continuation.resume(
                self._json_path, self.global_step, self._json_records(), self._rewrite_json)
        self._json_file = append_text(self._json_path)
        self._json_media = MediaFiles(self.log_dir)

    def log_dict(self, values: Mapping[str, float], step: int | None = None) -> None:
        super().log_dict(values, step)
        self._write_record(values, step)

    def _write_record(self, values: Mapping[str, Any], step: int | None = None) -> None:
        if self._json_file is None:
            return
        step = self.global_step if step is None else step
        if self._json_continuation is not None and not self._json_continuation.settle(
                step, values, self._json_records, self._rewrite_json):
            self._json_continuation = None
        self._json_file.write(json.dumps({"step": step, **values}) + "\n")
        self._json_file.flush()

    def _json_records(self) -> list[Row | None]:
        """The file's records; None for a line that is not one (a write cut short)."""
        records: list[Row | None] = []
        with read_text(self._json_path) as file:
            for line in file:
                try:
                    record = json.loads(line) if line.endswith("\n") else None
                except ValueError:
                    record = None
                records.append(record if isinstance(record, dict) else None)
        return records

    def _rewrite_json(self, records: list[Row]) -> None:
        """Replace the file by ``records`` as a whole; the appending handle, if open,
        follows."""
        if self._json_file is not None:
            self._json_file.close()
        write_atomically(self._json_path,
                         "".join(json.dumps(record) + "\n" for record in records).encode())
        if self._json_file is not None:
            self._json_file = append_text(self._json_path)

    def log_images(self, key: str, images: ImagesLike,
                   captions: Sequence[str] | None = None) -> None:
        super().log_images(key, images, captions)
        if self._json_media is not None:
            paths = self._json_media.images(key, self.global_step, to_uint8_images(images))
            self._write_record({key: {"_type": "images", "paths": paths,
                                      "captions": list(captions or [])}})

    def log_video(self, key: str, frames: torch.Tensor, fps: float) -> None:
        super().log_video(key, frames, fps)
        if self._json_media is not None:
            path = self._json_media.video(key, self.global_step, to_uint8_video(frames), fps)
            self._write_record({key: {"_type": "video", "path": path, "fps": fps}})

    def log_histogram(self, key: str, values: torch.Tensor) -> None:
        super().log_histogram(key, values)
        if self._json_file is not None:
            histogram = Histogram.from_values(values, self.logging_parameters.histogram_bins)
            self._write_record({key: {"_type": "histogram", **vars(histogram)}})

    def log_table(self, key: str, columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
        super().log_table(key, columns, rows)
        self._write_record({key: {"_type": "table", "columns": list(columns),
                                  "rows": [[plain(value) for value in row] for row in rows]}})

    def log_text(self, key: str, text: str) -> None:
        super().log_text(key, text)
        self._write_record({key: {"_type": "text", "text": text}})

    def log_config(self, config: dict[str, Any]) -> None:
        super().log_config(config)
        write_atomically(self.log_dir / "config.json", json.dumps(config, indent=2).encode())

    def finish(self) -> None:
        super().finish()
        if self._json_file is not None:
            self._json_file.close()
            self._json_file = None
            self._json_media = None
