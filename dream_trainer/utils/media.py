"""Images, videos, histograms and tables as logging backends store them.

Tensors become uint8 pixels in (N, H, W, C) order, grids, PNG and animated PNG (APNG) bytes,
or histogram bins, with torch and the standard library only: the JSONL and CSV loggers need
no imaging package, and ``import dream_trainer`` loads none.
"""

from __future__ import annotations

import json
import math
import re
import struct
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from dream_trainer.utils.files import make_dirs, write_atomically

ImagesLike = torch.Tensor | Sequence[torch.Tensor]
"""A batch ``(N, C, H, W)``, one image ``(C, H, W)`` or ``(H, W)``, or a sequence of images
of one size; float in [0, 1] (clamped) or uint8; C is 1 (gray), 3 (RGB) or 4 (RGBA)."""

_CHANNELS = (1, 3, 4)
_PNG_COLOR_TYPE = {1: 0, 3: 2, 4: 6}  # gray, RGB, RGBA
_PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


# -- checking and converting ---------------------------------------------------------------------
def check_images(images: ImagesLike, captions: Sequence[str] | None = None) -> int:
    """Check the form of ``images`` (no device sync); return how many images there are.

    Raises:
        TypeError: if ``images`` is not a tensor (or a sequence of tensors) of a float or uint8
            dtype.
        ValueError: if a shape is not ``(N, C, H, W)``, ``(C, H, W)`` or ``(H, W)`` with C in
            1, 3, 4, the images differ in size, or ``captions`` do not match one per image.
    """
    batch = _as_batch_shapes(images)
    if captions is not None and len(captions) != len(batch):
        raise ValueError(f"{len(captions)} captions for {len(batch)} images: give one caption "
                         "per image, or none")
    if len(set(batch)) > 1:
        raise ValueError(f"images of different sizes {sorted(set(batch))}: log images of one "
                         "size together (resize them, or log them under different keys)")
    return len(batch)


def check_video(frames: torch.Tensor, fps: float) -> None:
    """Check that ``frames`` is one ``(T, C, H, W)`` video and ``fps`` is positive.

    Raises:
        TypeError: if ``frames`` is not a float or uint8 tensor.
        ValueError: for another shape, or a non-positive or non-finite ``fps``.
    """
    if not isinstance(frames, torch.Tensor) or frames.dim() != 4:
        shape = tuple(frames.shape) if isinstance(frames, torch.Tensor) else type(frames).__name__
        raise ValueError(f"a video is one (T, C, H, W) tensor of frames, got {shape}")
    _check_dtype(frames)
    if frames.shape[1] not in _CHANNELS:
        raise ValueError(f"video frames have {frames.shape[1]} channels (shape "
                         f"{tuple(frames.shape)}): frames are (T, C, H, W) with C in 1, 3, 4")
    if not (isinstance(fps, (int, float)) and fps > 0 and math.isfinite(fps)):
        raise ValueError(f"fps must be a positive number of frames per second, got {fps!r}")


def to_uint8_images(images: ImagesLike) -> torch.Tensor:
    """``images`` as one uint8 ``(N, H, W, C)`` tensor on the CPU (a device sync).

    Float values are taken as [0, 1], clamped, scaled by 255 and rounded.
    """
    check_images(images)
    if isinstance(images, torch.Tensor):
        batch = images if images.dim() == 4 else images.reshape(1, -1, *images.shape[-2:])
    else:
        batch = torch.stack([image.reshape(-1, *image.shape[-2:]) for image in images])
    return _to_uint8(batch).permute(0, 2, 3, 1).contiguous()


def to_uint8_video(frames: torch.Tensor) -> torch.Tensor:
    """``(T, C, H, W)`` frames as a uint8 ``(T, H, W, C)`` tensor on the CPU (a device sync)."""
    return _to_uint8(frames).permute(0, 2, 3, 1).contiguous()


def _to_uint8(batch: torch.Tensor) -> torch.Tensor:
    batch = batch.detach()
    if batch.dtype != torch.uint8:
        batch = batch.float().clamp(0, 1).mul(255).round().to(torch.uint8)
    return batch.cpu()


def _check_dtype(tensor: torch.Tensor) -> None:
    if tensor.dtype != torch.uint8 and not tensor.is_floating_point():
        raise TypeError(f"pixels must be floats in [0, 1] or uint8 in [0, 255], got "
                        f"{tensor.dtype}: convert with tensor.float() / 255 or .to(torch.uint8)")


def _as_batch_shapes(images: ImagesLike) -> list[tuple[int, int, int]]:
    """The ``(C, H, W)`` of each image of ``images``."""
    if isinstance(images, torch.Tensor):
        items = list(images) if images.dim() == 4 else [images]
    elif isinstance(images, Sequence) and images and all(
            isinstance(image, torch.Tensor) for image in images):
        items = list(images)
    else:
        raise TypeError("images must be a tensor (N, C, H, W), (C, H, W) or (H, W), or a "
                        f"non-empty sequence of (C, H, W) tensors; got {type(images).__name__}")
    shapes = []
    for image in items:
        _check_dtype(image)
        shape = (1, *image.shape) if image.dim() == 2 else tuple(image.shape)
        if len(shape) != 3 or shape[0] not in _CHANNELS:
            raise ValueError(f"an image of shape {tuple(image.shape)}: images are (C, H, W) "
                             "with C in 1, 3, 4 (channels first), or (H, W) for gray")
        shapes.append(shape)
    if not shapes:
        raise ValueError("no images to log: the batch is empty")
    return shapes


def make_grid(images: torch.Tensor, nrow: int | None = None, padding: int = 2) -> torch.Tensor:
    """Tile uint8 ``(N, H, W, C)`` images into one ``(H', W', C)`` image, row by row.

    Args:
        images: The images, as ``to_uint8_images`` returns them.
        nrow: Images per row; ``ceil(sqrt(N))`` when None.
        padding: Black pixels around and between the images.

    Returns:
        The grid; the cells after the last image stay black.
    """
    count, height, width, channels = images.shape
    columns = min(count, nrow or math.ceil(math.sqrt(count)))
    rows = math.ceil(count / columns)
    grid = torch.zeros((rows * (height + padding) + padding, columns * (width + padding) + padding,
                        channels), dtype=torch.uint8)
    for index in range(count):
        top = padding + (index // columns) * (height + padding)
        left = padding + (index % columns) * (width + padding)
        grid[top:top + height, left:left + width] = images[index]
    return grid


# -- encoding ------------------------------------------------------------------------------------
def _chunk(kind: bytes, data: bytes) -> bytes:
    return (struct.pack(">I", len(data)) + kind + data
            + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF))


def _header(height: int, width: int, channels: int) -> bytes:
    # 8 bits per channel, deflate, adaptive filtering, no interlace.
    return _chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8,
                                       _PNG_COLOR_TYPE[channels], 0, 0, 0))


def _pixels(image: torch.Tensor) -> bytes:
    """The zlib stream of one frame: each row prefixed with filter type 0 (none)."""
    height = image.shape[0]
    rows = torch.cat([torch.zeros((height, 1), dtype=torch.uint8),
                      image.reshape(height, -1)], dim=1)
    return zlib.compress(_bytes(rows), 6)


def _bytes(tensor: torch.Tensor) -> bytes:
    """The raw bytes of a uint8 CPU tensor."""
    try:
        return tensor.contiguous().numpy().tobytes()
    except (ImportError, RuntimeError):  # torch without numpy: slower, same bytes
        return bytes(tensor.flatten().tolist())


def encode_png(image: torch.Tensor) -> bytes:
    """A uint8 ``(H, W, C)`` image as PNG bytes."""
    height, width, channels = image.shape
    return (_PNG_SIGNATURE + _header(height, width, channels)
            + _chunk(b"IDAT", _pixels(image)) + _chunk(b"IEND", b""))


def encode_apng(frames: torch.Tensor, fps: float) -> bytes:
    """Uint8 ``(T, H, W, C)`` frames as an animated PNG that loops forever.

    Browsers and TensorBoard play it; viewers without APNG support show the first frame.
    """
    count, height, width, channels = frames.shape
    # The frame delay is a fraction of uint16 numerator and denominator.
    delay = max(1, min(65535, round(1000 / fps)))
    parts = [_PNG_SIGNATURE, _header(height, width, channels),
             _chunk(b"acTL", struct.pack(">II", count, 0))]
    sequence = 0
    for index in range(count):
        control = struct.pack(">IIIIIHHBB", sequence, width, height, 0, 0, delay, 1000, 0, 0)
        parts.append(_chunk(b"fcTL", control))
        sequence += 1
        data = _pixels(frames[index])
        if index == 0:
            parts.append(_chunk(b"IDAT", data))
        else:
            parts.append(_chunk(b"fdAT", struct.pack(">I", sequence) + data))
            sequence += 1
    parts.append(_chunk(b"IEND", b""))
    return b"".join(parts)


# -- histograms and tables -----------------------------------------------------------------------
@dataclass(frozen=True)
class Histogram:
    """Equal-width bins over the finite values of a tensor, with the summary TensorBoard keeps.

    Attributes:
        counts: Values per bin; bin ``i`` is ``[edges[i], edges[i + 1])``, the last one closed.
        edges: ``len(counts) + 1`` bin edges, from the smallest value to the largest (widened
            by 0.5 each way when all values are equal).
        num, min, max, sum, sum_squares: Of the finite values (``min``/``max`` 0 when none).
    """

    counts: list[int]
    edges: list[float]
    num: int
    min: float
    max: float
    sum: float
    sum_squares: float

    @classmethod
    def from_values(cls, values: torch.Tensor, bins: int = 64) -> Histogram:
        """Bin ``values`` (any shape, on any device; one device sync).

        Raises:
            ValueError: if ``bins < 1``.
        """
        if bins < 1:
            raise ValueError(f"a histogram needs at least 1 bin, got bins={bins}")
        flat = values.detach().reshape(-1).double()
        flat = flat[torch.isfinite(flat)]
        if flat.numel() == 0:
            return cls([0] * bins, torch.linspace(0, 1, bins + 1).tolist(), 0, 0.0, 0.0, 0.0, 0.0)
        low, high = flat.min(), flat.max()
        stats = torch.stack([low, high, flat.sum(), flat.square().sum()]).tolist()
        low_value, high_value = stats[0], stats[1]
        if low_value == high_value:
            low_value, high_value = low_value - 0.5, high_value + 0.5
        counts = torch.histc(flat, bins=bins, min=low_value, max=high_value)
        edges = torch.linspace(low_value, high_value, bins + 1, dtype=torch.float64)
        return cls([int(c) for c in counts.tolist()], edges.tolist(), flat.numel(),
                   stats[0], stats[1], stats[2], stats[3])


def check_table(columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
    """Check that every row has one value per column.

    Raises:
        ValueError: naming the first row of another length, or for no columns.
    """
    if isinstance(columns, str) or not columns:
        raise ValueError(f"columns must be a non-empty list of names, got {columns!r}")
    for index, row in enumerate(rows):
        if isinstance(row, str) or len(row) != len(columns):
            raise ValueError(f"table row {index} has {len(row)} values for {len(columns)} "
                             f"columns {list(columns)}: give one value per column")


def plain(value: Any) -> Any:
    """A table cell as a JSON value: one-element tensors and numpy scalars as numbers, other
    tensors as nested lists, anything else not JSON-native as its ``str``."""
    if isinstance(value, torch.Tensor):
        return value.item() if value.numel() == 1 else value.tolist()
    if hasattr(value, "item") and callable(value.item):  # numpy scalars
        return value.item()
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return str(value)


def markdown_table(columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A GitHub-style markdown table (TensorBoard's text dashboard renders it)."""
    def cell(value: Any) -> str:
        return str(plain(value)).replace("|", "\\|").replace("\n", " ")

    lines = ["| " + " | ".join(cell(c) for c in columns) + " |",
             "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


# -- files ------------------------------------------------------------------------------------------
class MediaFiles:
    """Writes media under ``<log_dir>/media/`` and returns paths relative to ``log_dir``.

    Files are named ``<key>_step<N>[_<i>].<ext>``, the key's characters other than letters,
    digits, ``.``, ``-`` and ``_`` replaced by ``_`` (``val/samples`` -> ``val_samples``). A
    step logged again (a resumed run repeating it) overwrites its files.

    Args:
        log_dir: The logger's ``log_dir``.
    """

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.directory = log_dir / "media"

    def _path(self, key: str, step: int, suffix: str) -> Path:
        make_dirs(self.directory)  # a link planted as the folder is refused
        return self.directory / f"{re.sub(r'[^A-Za-z0-9_.-]', '_', key)}_step{step}{suffix}"

    def _write(self, path: Path, data: bytes) -> str:
        write_atomically(path, data)  # replaces a link planted as the file
        return path.relative_to(self.log_dir).as_posix()

    def images(self, key: str, step: int, images: torch.Tensor) -> list[str]:
        """Write uint8 ``(N, H, W, C)`` images as PNG files, ``..._<i>.png``."""
        return [self._write(self._path(key, step, f"_{index}.png"), encode_png(image))
                for index, image in enumerate(images)]

    def video(self, key: str, step: int, frames: torch.Tensor, fps: float) -> str:
        """Write uint8 ``(T, H, W, C)`` frames as one animated PNG."""
        return self._write(self._path(key, step, ".png"), encode_apng(frames, fps))

    def table(self, key: str, step: int, columns: Sequence[str],
              rows: Sequence[Sequence[Any]]) -> str:
        """Write a table as ``.table.json``: ``{"columns": [...], "rows": [[...], ...]}``."""
        data = {"columns": list(columns), "rows": [[plain(v) for v in row] for row in rows]}
        return self._write(self._path(key, step, ".table.json"), json.dumps(data).encode())

    def histogram(self, key: str, step: int, histogram: Histogram) -> str:
        """Write a histogram as ``.histogram.json`` (the fields of ``Histogram``)."""
        return self._write(self._path(key, step, ".histogram.json"),
                           json.dumps(vars(histogram)).encode())
