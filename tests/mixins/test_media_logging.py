"""Media on every backend: JSONL files, TensorBoard events read back with tensorboard's own
reader, the CSV file, wandb's offline run; MediaLogger and Histograms on 2 real ranks."""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image

from dream_trainer.callbacks import MediaLogger, RankZeroCallback
from dream_trainer.configs import LoggingParameters
from dream_trainer.mixins import (CSVLoggerConfigMixin, CSVLoggerMixin, JSONLoggerConfigMixin,
                                  JSONLoggerMixin, TensorBoardLoggerConfigMixin,
                                  TensorBoardLoggerMixin, WandBLoggerConfigMixin,
                                  WandBLoggerMixin)
from dream_trainer.utils.media import Histogram, make_grid
from tests.helpers.launch import REPO, check, torchrun
from tests.helpers.toy import ToyConfig, ToyTrainer, toy_config
from tests.helpers.wandb_files import read_run

# What the probe logs after validation, and what each backend must give back.
IMAGES = torch.rand(2, 3, 4, 5, generator=torch.Generator().manual_seed(0))
IMAGES_UINT8 = (IMAGES * 255).round().to(torch.uint8).permute(0, 2, 3, 1).numpy()
FRAMES = torch.randint(0, 256, (3, 1, 4, 6), dtype=torch.uint8,
                       generator=torch.Generator().manual_seed(1))
# The integer k appears k + 1 times; 10 bins over [0, 9] are 0.9 wide, so k falls in bin k.
VALUES = torch.arange(10.0).repeat_interleave(torch.arange(1, 11))
ROWS = [["a", 1], ["b", torch.tensor(2.5)]]


class AllConfig(ToyConfig, JSONLoggerConfigMixin, TensorBoardLoggerConfigMixin,
                CSVLoggerConfigMixin, WandBLoggerConfigMixin):
    pass


class AllBackends(ToyTrainer, JSONLoggerMixin, TensorBoardLoggerMixin, CSVLoggerMixin,
                  WandBLoggerMixin):
    def validation_step(self, batch: Any, batch_idx: int) -> dict[str, Any]:
        x, _ = batch
        # Videos of 2 frames, 2 x 4 pixels, one channel: a batch of (B, T, C, H, W).
        return {**super().validation_step(batch, batch_idx),
                "clips": torch.sigmoid(x).reshape(-1, 2, 1, 2, 2)}


class Probe(RankZeroCallback):
    def post_val_epoch(self, result: dict[str, Any]) -> None:
        trainer = self.trainer
        trainer.log_images("samples", IMAGES, captions=["first", "second"])
        trainer.log_video("frames", FRAMES, fps=5)
        trainer.log_histogram("spread", VALUES)
        trainer.log_table("scores", ["name", "score"], ROWS)
        trainer.log_text("note", "hello *world*")


@pytest.fixture(scope="module")
def logs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One run through all four backends: 4 steps, scalars every 2, one validation pass."""
    root = tmp_path_factory.mktemp("media")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("WANDB_SILENT", "true")
        base = toy_config(n_samples=32, val_samples=8, val_batch_size=4)
        config = AllConfig(**{**dict(base), "callbacks": [
            Probe(), MediaLogger("clips", max_samples=3, nrow=2, fps=4)],
            "logging_parameters": LoggingParameters(log_dir=root, log_every_n_steps=2,
                                                    histogram_bins=10)})
        AllBackends(config).fit()
    return root / "toy/tests/run/logs"


def jsonl(logs: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (logs / "metrics.jsonl").read_text().splitlines()]


def scalar_rows(logs: Path) -> list[dict[str, Any]]:
    return [{k: v for k, v in row.items() if not isinstance(v, dict)} for row in jsonl(logs)
            if any(not isinstance(v, dict) for k, v in row.items() if k != "step")]


def media(logs: Path, key: str) -> dict[str, Any]:
    (record,) = [row for row in jsonl(logs) if key in row]
    assert record["step"] == 4
    return record[key]  # type: ignore[no-any-return]


def decode(data: bytes) -> list[np.ndarray]:
    """Every frame of a PNG or animated PNG, as (H, W, C) uint8."""
    image = Image.open(io.BytesIO(data))
    frames = []
    for index in range(getattr(image, "n_frames", 1)):
        image.seek(index)
        array = np.array(image)
        frames.append(array[..., None] if array.ndim == 2 else array)
    return frames


def test_jsonl_writes_media_files_and_records(logs: Path) -> None:
    images = media(logs, "samples")
    assert images["_type"] == "images" and images["captions"] == ["first", "second"]
    assert images["paths"] == ["media/samples_step4_0.png", "media/samples_step4_1.png"]
    for path, expected in zip(images["paths"], IMAGES_UINT8):
        assert np.array_equal(decode((logs / path).read_bytes())[0], expected)
    video = media(logs, "frames")
    assert video == {"_type": "video", "path": "media/frames_step4.png", "fps": 5}
    frames = decode((logs / video["path"]).read_bytes())
    assert np.array_equal(np.stack(frames), FRAMES.permute(0, 2, 3, 1).numpy())
    spread = media(logs, "spread")
    assert spread["counts"] == list(range(1, 11)) and spread["num"] == 55
    assert spread["edges"] == pytest.approx([0.9 * k for k in range(11)])
    assert media(logs, "scores") == {"_type": "table", "columns": ["name", "score"],
                                     "rows": [["a", 1], ["b", 2.5]]}
    assert media(logs, "note") == {"_type": "text", "text": "hello *world*"}


def test_media_logger_logs_a_grid_video_of_the_first_samples(logs: Path) -> None:
    # Validation: 8 samples in batches of 4; the first 3 clips, 2 to a row of the grid.
    from tests.helpers.toy import toy_dataset

    x = toy_dataset(8, toy_config(), seed=2).tensors[0]
    clips = torch.sigmoid(x).reshape(-1, 2, 1, 2, 2)[:3]
    as_uint8 = (clips * 255).round().to(torch.uint8).permute(1, 0, 3, 4, 2)  # T, B, H, W, C
    expected = np.stack([make_grid(frame, nrow=2).numpy() for frame in as_uint8])
    video = media(logs, "clips")
    assert video["fps"] == 4
    assert np.array_equal(np.stack(decode((logs / video["path"]).read_bytes())), expected)


def tensorboard(logs: Path) -> Any:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(str(logs / "tensorboard"), size_guidance={
        "scalars": 0, "tensors": 0, "histograms": 0})
    accumulator.Reload()
    return accumulator


def test_tensorboard_events_match_the_jsonl_and_the_logged_media(logs: Path) -> None:
    from tensorboard.util import tensor_util

    events = tensorboard(logs)
    expected: dict[str, list[tuple[int, float]]] = {}
    for row in scalar_rows(logs):
        for key, value in row.items():
            if key != "step":
                # TensorBoard keeps scalars as float32: equal once rounded the same way.
                expected.setdefault(key, []).append((row["step"], float(np.float32(value))))
    assert set(events.Tags()["scalars"]) == set(expected)
    for key, points in expected.items():
        assert [(event.step, event.value) for event in events.Scalars(key)] == points, key
    # Images: one summary holding width, height and a PNG per image.
    (image_event,) = events.Tensors("samples")
    width, height, *pngs = tensor_util.make_ndarray(image_event.tensor_proto).tolist()
    assert (image_event.step, int(width), int(height)) == (4, 5, 4)
    assert [decode(png)[0].tolist() for png in pngs] == IMAGES_UINT8.tolist()
    (video_event,) = events.Tensors("frames")
    animation = tensor_util.make_ndarray(video_event.tensor_proto).tolist()[2]
    assert np.array_equal(np.stack(decode(animation)), FRAMES.permute(0, 2, 3, 1).numpy())
    (histogram_event,) = events.Histograms("spread")
    histogram = histogram_event.histogram_value
    assert list(histogram.bucket) == list(range(1, 11))
    assert list(histogram.bucket_limit) == pytest.approx([0.9 * k for k in range(1, 11)])
    assert (histogram.num, histogram.min, histogram.max, histogram.sum) == (55, 0, 9, 330)
    (note,) = events.Tensors("note/text_summary")
    assert tensor_util.make_ndarray(note.tensor_proto).tolist() == [b"hello *world*"]
    (table,) = events.Tensors("scores/text_summary")
    assert tensor_util.make_ndarray(table.tensor_proto).tolist() == [
        b"| name | score |\n|---|---|\n| a | 1 |\n| b | 2.5 |"]


def test_csv_has_one_column_per_key_and_the_jsonl_values(logs: Path) -> None:
    with open(logs / "metrics.csv", newline="") as file:
        rows = list(csv.DictReader(file))
        header = list(rows[0])
    # Columns in the order keys first appeared: each new one rewrote the header.
    assert header == ["step", "loss", "grad_norm", "trainer/global_step", "trainer/epoch",
                      "train_epoch/loss", "train_epoch/grad_norm", "val_loss", "samples",
                      "frames", "spread", "scores", "note", "clips"]
    scalars = [{k: float(v) for k, v in row.items() if v and k in header[:8]} for row in rows]
    assert [row for row in scalars if len(row) > 1] == [
        {k: float(v) for k, v in row.items()} for row in scalar_rows(logs)]
    media_cells = {key: row[key] for row in rows for key in header[8:] if row[key]}
    assert media_cells["samples"] == "media/samples_step4_0.png;media/samples_step4_1.png"
    assert media_cells["note"] == "hello *world*"
    assert json.loads((logs / media_cells["scores"]).read_text()) == {
        "columns": ["name", "score"], "rows": [["a", 1], ["b", 2.5]]}
    assert json.loads((logs / media_cells["spread"]).read_text())["counts"] == list(range(1, 11))
    assert (logs / media_cells["frames"]).is_file()


def test_a_second_run_appends_under_the_existing_header(tmp_path: Path) -> None:
    class CSVConfig(ToyConfig, CSVLoggerConfigMixin):
        pass

    class CSVTrainer(ToyTrainer, CSVLoggerMixin):
        pass

    def fit(**extra: Any) -> None:
        base = toy_config(n_samples=16)
        CSVTrainer(CSVConfig(**{**dict(base), **extra, "logging_parameters": LoggingParameters(
            log_dir=tmp_path, log_every_n_steps=1)})).fit()

    fit()
    path = tmp_path / "toy/tests/run/logs/metrics.csv"
    first = path.read_text().splitlines()
    fit()
    second = path.read_text().splitlines()
    assert second[: len(first)] == first and len(second) == 2 * len(first) - 1
    assert second.count(first[0]) == 1  # one header, not one per run


def test_wandb_offline_run_holds_the_media_and_tables(logs: Path) -> None:
    (run_dir,) = (logs / "wandb").glob("offline-run-*")
    history = read_run(next(run_dir.glob("run-*.wandb")))["history"]
    row = next(row for row in history if "samples/_type" in row)
    assert row["_step"] == 4

    def field(key: str) -> dict[str, Any]:
        """A media value, which the record log keeps as one item per field."""
        return {name.split("/", 1)[1]: value for name, value in row.items()
                if name.startswith(f"{key}/")}

    images = field("samples")
    assert images["_type"] == "images/separated" and images["captions"] == ["first", "second"]
    for name, expected in zip(images["filenames"], IMAGES_UINT8):
        assert np.array_equal(decode((run_dir / "files" / name).read_bytes())[0], expected)
    video = field("frames")
    assert video["_type"] == "video-file"
    gif = Image.open(run_dir / "files" / video["path"])
    assert gif.format == "GIF" and gif.n_frames == 3
    spread = field("spread")
    assert spread["_type"] == "histogram" and spread["values"] == list(range(1, 11))
    assert spread["bins"] == pytest.approx([0.9 * k for k in range(11)])
    table = field("scores")
    assert table["_type"] == "table-file"
    assert json.loads((run_dir / "files" / table["path"]).read_text())["data"] == [
        ["a", 1], ["b", 2.5]]
    note = field("note")
    assert note["_type"] == "table-file"
    assert json.loads((run_dir / "files" / note["path"]).read_text())["data"] == [
        ["hello *world*"]]


@pytest.mark.parametrize(("call", "message"), [
    (lambda t: t.log_images("x", torch.rand(2, 5, 4, 4)), "channels first"),
    (lambda t: t.log_images("x", torch.rand(2, 3, 4, 4), captions=["one"]), "1 captions for 2"),
    (lambda t: t.log_images("x", torch.ones(3, 4, 4, dtype=torch.int64)), "uint8"),
    (lambda t: t.log_video("x", torch.rand(3, 4, 4), fps=4), r"\(T, C, H, W\)"),
    (lambda t: t.log_video("x", torch.rand(2, 3, 4, 4), fps=0), "fps must be a positive number"),
    (lambda t: t.log_table("x", ["a", "b"], [[1, 2], [3]]), "row 1 has 1 values for 2"),
    (lambda t: t.log_histogram("x", [1.0, 2.0]), "takes a tensor"),
    (lambda t: t.log_text("x", 3), "takes a str"),
])
def test_bad_media_is_an_error_on_every_rank_even_without_a_run(
        call: Any, message: str) -> None:
    class JSONConfig(ToyConfig, JSONLoggerConfigMixin):
        pass

    class JSONTrainer(ToyTrainer, JSONLoggerMixin):
        pass

    trainer = JSONTrainer(JSONConfig(**dict(toy_config())))  # never fitted: no open run
    with pytest.raises((TypeError, ValueError), match=message):
        call(trainer)


@pytest.mark.distributed
def test_media_logger_on_rank_zero_and_full_histograms_under_fsdp_and_tp(tmp_path: Path) -> None:
    check(torchrun(REPO / "tests/scripts/observability_run.py", [str(tmp_path)]))
    ranks = [torch.load(tmp_path / f"rank{rank}.pt", weights_only=False) for rank in (0, 1)]
    # MediaLogger: one call, on rank 0 only, after the (unlogged) sanity check.
    assert ranks[0]["media_calls"] == [("samples", (1, 10, 20))]
    assert ranks[1]["media_calls"] == []
    media_dir = tmp_path / "obs/tests/media/logs"
    (record,) = [row for row in jsonl(media_dir) if "samples" in row]
    # The grid: rank 0's first 6 samples (its first batch of 4, then 2), 3 to a row.
    first = torch.cat(ranks[0]["returned"])[:6]
    expected = make_grid((first * 255).round().to(torch.uint8).permute(0, 2, 3, 1), nrow=3)
    (path,) = record["samples"]["paths"]
    assert np.array_equal(decode((media_dir / path).read_bytes())[0], expected.numpy())
    # Histograms: the logged distribution of each full tensor is the one-process histogram
    # of the same (gathered) tensor, over every element, not rank 0's shard.
    for mode in ("fsdp", "tp"):
        logged = {(row["step"], key): value for row in jsonl(tmp_path / f"obs/tests/{mode}/logs")
                  for key, value in row.items() if isinstance(value, dict)}
        gathered = ranks[0][mode]
        assert sorted(gathered) == [0, 2]
        expected_keys = {(step, key) for step, tensors in gathered.items() for key in tensors}
        assert set(logged) == expected_keys and len(expected_keys) == 16, mode
        for step, tensors in gathered.items():
            for key, tensor in tensors.items():
                histogram = logged[(step, key)]
                assert histogram["num"] == tensor.numel(), (mode, key)
                one_process = Histogram.from_values(tensor, 64)
                assert histogram["counts"] == one_process.counts, (mode, step, key)
                assert histogram["edges"] == one_process.edges, (mode, step, key)
