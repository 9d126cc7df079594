"""Script: pretrained weights in from s3:// and out to s3:// under FSDP2. A tiny Llama's
Hugging Face folder at PRETRAINED_URL is loaded (each rank reading its slices by byte
ranges), fine-tuned 3 steps with checkpoints under ROOT_URL, and exported from inside the run
to ROOT_URL/live; a second run then starts from the first one's final checkpoint in the
bucket. Each rank saves what it saw to OUT_DIR/rank<r>.pt.

    torchrun --nproc_per_node=2 object_store_weights.py OUT_DIR PRETRAINED_URL ROOT_URL

The endpoint and credentials come from the environment (tests/helpers/s3.py sets them).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import IO, Any

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from dream_trainer.checkpoint.object_store import ObjectStorage
from dream_trainer.checkpoint.storage import ObjectPath
from dream_trainer.configs import CheckpointParameters, DeviceParameters
from tests.helpers.hf import hf_config
from tests.scripts.hf_run import Run, RunConfig

# Small read-ahead blocks, so that the bytes fetched show which slices a rank read: the
# tiny model's whole file is smaller than the default block.
ObjectStorage.read_block_bytes = 256


class Opened:
    """Every object the storage opened for reading, with its file's cache (which counts
    what it fetched, and outlives the file): checkpoint files (``open``) and pretrained
    weights (``open_file``)."""

    files: list[tuple[str, str, Any]] = []

    @classmethod
    def record(cls) -> None:
        for method in ("open", "open_file"):
            original = getattr(ObjectStorage, method)

            def opening(self: ObjectStorage, path: ObjectPath, original: Any = original,
                        method: str = method) -> IO[bytes]:
                file = original(self, path)
                cls.files.append((method, path.name, file.cache))  # type: ignore[attr-defined]
                return file

            setattr(ObjectStorage, method, opening)

    @classmethod
    def take(cls) -> list[tuple[str, str, Any]]:
        files, cls.files = cls.files, []
        return files


def full_weights(trainer: Run) -> dict[str, torch.Tensor]:
    return get_model_state_dict(trainer.model, options=StateDictOptions(
        full_state_dict=True, cpu_offload=True))


class WeightsRun(Run):
    """``Run``, also keeping the full weights right after setup and at the end (gathered
    while the process group exists)."""

    def post_setup(self) -> None:
        self.opened_in_setup = Opened.take()
        super().post_setup()
        self.loaded = full_weights(self)

    def post_fit(self) -> None:
        super().post_fit()
        self.trained = full_weights(self)


def start(experiment: str, source: str, root: str) -> WeightsRun:
    base = hf_config(device_parameters=DeviceParameters.FSDP(), init_weights_from=source)
    return WeightsRun(RunConfig(**{**dict(base), "experiment": experiment},
                                checkpoint_parameters=CheckpointParameters(root_dir=root)))


def main(out_dir: str, pretrained: str, root: str) -> None:
    Opened.record()
    first = start("first", pretrained, root)
    first.export_dir = f"{root}/live"  # type: ignore[assignment]
    first.fit()
    weights = [(name, cache) for method, name, cache in first.opened_in_setup
               if method == "open_file" and name.endswith(".safetensors")]
    checkpoint = first.checkpoint_dir / f"step_{first.global_step}"
    Opened.take()  # the first run's commits and export read objects too
    second = start("second", str(checkpoint), root)
    second.export_dir = f"{root}/unused"  # type: ignore[assignment]
    second.fit()
    torch.save({
        "initial": first.initial, "final": first.final, "loaded": first.loaded,
        "trained": first.trained, "exported": {k: str(v) for k, v in first.exported.items()},
        "placements": first.placements, "checkpoint": str(checkpoint),
        # What each open of the weights file fetched from the server, header reads included.
        "fetched": [(name, cache.total_requested_bytes) for name, cache in weights],
        "second_loaded": second.loaded,
        "second_opened": sorted({name for method, name, _ in second.opened_in_setup
                                 if method == "open" and name.endswith(".distcp")}),
    }, Path(out_dir) / f"rank{os.environ['RANK']}.pt")


if __name__ == "__main__":
    main(*sys.argv[1:])
