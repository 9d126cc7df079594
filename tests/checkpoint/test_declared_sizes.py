"""Declared sizes are backed by stored bytes: a ``.metadata`` that declares a tensor larger
than its chunks store (a 63 KB checkpoint claiming a 1 GiB tensor), chunks that overlap or
leave a gap, or a billion empty experts, is refused before anything is allocated, within
seconds and megabytes, on every path that reads a checkpoint (resume, ``init_weights_from``,
export); and the chunk checks are linear, exact, for 200,000 chunks."""

from __future__ import annotations

import dataclasses
import json
import pickle
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file
from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, Metadata,
                                                   MetadataIndex, TensorProperties,
                                                   TensorStorageMetadata)

from dream_trainer.checkpoint.declared import check_declared_sizes
from dream_trainer.checkpoint.directory import INFO, METADATA, checksum
from dream_trainer.errors import CheckpointError
from dream_trainer.weights.hf import Files
from dream_trainer.weights.hf_reader import SliceReader, _check_coverage
from tests.helpers.crafted import measure_reads, one_epoch_checkpoint

SECONDS = 5.0
"""Most a crafted read may take (each is refused in milliseconds)."""
MEMORY_MULTIPLE = 8
MEMORY_CONSTANT = 64 << 20
"""A crafted read may grow the peak resident memory by at most 8 times the checkpoint's
bytes plus 64 MiB (Python objects of the metadata, an error's traceback): far below the
1 GiB the crafted sizes declare."""
HUGE = (16384, 16384)  # float32: 1 GiB declared
MODEL_KEY = "state.models.model.0.weight"


@pytest.fixture(scope="module")
def clean(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A one-epoch toy run's step_10 (about 90 KB)."""
    return one_epoch_checkpoint(tmp_path_factory.mktemp("run"))


def read_metadata(checkpoint: Path) -> Any:
    return pickle.loads((checkpoint / METADATA).read_bytes())  # our own file: trusted


def write_metadata(checkpoint: Path, metadata: Any) -> int:
    """Write crafted metadata and recompute dream_trainer.json's checksums, as anyone who can
    write the folder can; return the checkpoint's size in bytes."""
    (checkpoint / METADATA).write_bytes(pickle.dumps(metadata))
    info = json.loads((checkpoint / INFO).read_text())
    info["files"] = {name: checksum(checkpoint / name) for name in info["files"]}
    (checkpoint / INFO).write_text(json.dumps(info))
    return sum(path.stat().st_size for path in checkpoint.iterdir())


def declare(metadata: Any, key: str, size: tuple[int, ...],
            chunks: list[tuple[tuple[int, ...], tuple[int, ...]]], stored_as: str | None,
            dtype: torch.dtype = torch.float32) -> None:
    """Declare ``key`` of ``size`` made of ``chunks`` (offsets, sizes), each stored where the
    entry of ``stored_as`` (an existing key) is: a few kilobytes of real bytes."""
    metadata.state_dict_metadata[key] = TensorStorageMetadata(
        properties=TensorProperties(dtype=dtype), size=torch.Size(size),
        chunks=[ChunkStorageMetadata(offsets=torch.Size(o), sizes=torch.Size(s))
                for o, s in chunks])
    if stored_as is None:
        return
    original = next(info for index, info in metadata.storage_data.items()
                    if index.fqn == stored_as)
    for offsets, _ in chunks:
        metadata.storage_data[MetadataIndex(key, list(offsets))] = dataclasses.replace(original)


def one_huge_chunk(checkpoint: Path) -> int:
    # The export a reviewer made write 256 MiB: the model tensor declared 1 GiB, its one
    # chunk stored in the 1.5 KB entry of the real weight.
    metadata = read_metadata(checkpoint)
    declare(metadata, MODEL_KEY, HUGE, [((0, 0), HUGE)], stored_as=MODEL_KEY)
    return write_metadata(checkpoint, metadata)


def a_gap(checkpoint: Path) -> int:
    # Declared 1 GiB, the real 16x8 chunk its only one: every other element unstored.
    metadata = read_metadata(checkpoint)
    declare(metadata, MODEL_KEY, HUGE, [((0, 0), (16, 8))], stored_as=MODEL_KEY)
    return write_metadata(checkpoint, metadata)


def overlapping(checkpoint: Path) -> int:
    # Two chunks both at row 0 that together hold as many elements as the declared size.
    metadata = read_metadata(checkpoint)
    declare(metadata, MODEL_KEY, (32, 8), [((0, 0), (16, 8)), ((0, 0), (16, 8))],
            stored_as=MODEL_KEY)
    return write_metadata(checkpoint, metadata)


def extra_state_tensor(checkpoint: Path) -> int:
    # Resume allocates every state.tensors.* entry at its declared size.
    metadata = read_metadata(checkpoint)
    declare(metadata, "state.tensors.evil", HUGE, [((0, 0), HUGE)], stored_as=MODEL_KEY)
    return write_metadata(checkpoint, metadata)


def empty_experts(checkpoint: Path) -> int:
    # An MoE layer of a billion experts of no element each: no byte declared, yet an "hf"
    # export would name a billion file tensors per weight.
    metadata = read_metadata(checkpoint)
    for key, size in (("layers.0.moe.experts.w1", (10**9, 0, 8)),
                      ("layers.0.moe.router.weight", (0, 8))):
        declare(metadata, f"state.models.model.{key}", size, [((0,) * len(size), size)],
                stored_as=None)
    return write_metadata(checkpoint, metadata)


def honest(checkpoint: Path) -> int:
    return sum(path.stat().st_size for path in checkpoint.iterdir())


INPUTS: dict[str, tuple[Callable[[Path], int], tuple[str, ...], str | None]] = {
    # Read first: imports and one honest read of each kind set the baseline.
    "honest": (honest, ("export", "init", "resume"), None),
    "one_huge_chunk": (one_huge_chunk, ("export", "init", "resume"),
                       r"declares the tensor 'state\.models\.model\.0\.weight' \[16384, "
                       r"16384\], but its chunk at \[0, 0\] of \[16384, 16384\] elements "
                       r"needs 1073741824 bytes and its stored entry holds \d+: reading it "
                       "would allocate memory no stored bytes fill"),
    "a_gap": (a_gap, ("export", "init", "resume"),
              r"declares the tensor 'state\.models\.model\.0\.weight' \[16384, 16384\], but "
              r"its 1 chunks hold 128 of its 268435456 elements"),
    "overlapping": (overlapping, ("export", "init", "resume"),
                    r"\[32, 8\], but its 2 chunks overlap"),
    "extra_state_tensor": (extra_state_tensor, ("resume",),
                           r"declares the tensor 'state\.tensors\.evil' \[16384, 16384\], but "
                           r"its chunk at \[0, 0\] of \[16384, 16384\] elements needs "
                           r"1073741824 bytes"),
    "empty_experts": (empty_experts, ("export_hf",),
                      r"ValueError: layers\.0\.moe\.experts\.w1 \[1000000000, 0, 8\] stacks "
                      r"experts that hold no element"),
}


@pytest.fixture(scope="module")
def costs(clean: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    measured = measure_reads(INPUTS, clean, tmp_path_factory.mktemp("declared"),
                             "honest/resume")
    print(json.dumps({name: {"seconds": round(case["seconds"], 3),
                             "peak_growth_mib": round((case["peak"] - measured[
                                 "honest/resume"]["peak"]) / 2**20, 1),
                             "size": case["size"]} for name, case in measured.items()
                      if name != "warm"}))
    return measured


@pytest.mark.parametrize("case", [f"{name}/{entry}" for name, (_, entries, _) in INPUTS.items()
                                  for entry in entries])
def test_each_crafted_size_is_refused_within_its_bytes(costs: dict[str, Any],
                                                       case: str) -> None:
    measured = costs[case]
    expected = INPUTS[case.split("/")[0]][2]
    if expected is None:
        assert measured["error"] is None, measured["error"]
    else:
        assert measured["error"] is not None, f"{case} was read"
        assert re.search(expected, measured["error"]), measured["error"]
    assert measured["seconds"] < SECONDS
    if not case.startswith("honest"):
        # The peak only grows: bounding it after this case bounds every case before it.
        growth = measured["peak"] - costs["warm"]
        assert growth <= MEMORY_MULTIPLE * measured["size"] + MEMORY_CONSTANT, growth / 2**20


# -- the chunk checks at scale ------------------------------------------------------------------
CHUNKS = 200_000
"""One-element chunks of one tensor: what a 10 MB folder of tiny files holds, which a check
of every pair took an hour over."""


def chunked(count: int) -> TensorStorageMetadata:
    one = torch.Size([1, 1])
    return TensorStorageMetadata(
        properties=TensorProperties(dtype=torch.float32), size=torch.Size([count, 1]),
        chunks=[ChunkStorageMetadata(offsets=torch.Size([i, 0]), sizes=one)
                for i in range(count)])


@dataclasses.dataclass
class _Info:
    """A stored entry as DCP's ``_StorageInfo`` (the length) and the Hugging Face reader's
    ``_Stored`` (the file) give it."""

    relative_path: str
    offset: int
    length: int
    transform_descriptors: Any = None

    @property
    def file(self) -> str:
        return f"{self.offset // 4}.safetensors"


def test_200k_one_element_chunks_are_checked_in_seconds_and_one_overlap_is_found() -> None:
    entry = chunked(CHUNKS)
    storage = {MetadataIndex("w", list(chunk.offsets)): _Info("__0_0.distcp", 4 * i, 4)
               for i, chunk in enumerate(entry.chunks)}
    metadata = Metadata(state_dict_metadata={"w": entry},  # type: ignore[dict-item]
                        storage_data=storage)
    start = time.perf_counter()
    check_declared_sizes("ckpt/.metadata", metadata)
    assert time.perf_counter() - start < SECONDS
    start = time.perf_counter()
    _check_coverage("w", entry, metadata, Path("hf"))
    assert time.perf_counter() - start < SECONDS
    # One chunk moved onto its neighbour: as many elements as the tensor, one held twice,
    # one by none. A sum of elements alone would pass it.
    entry.chunks[CHUNKS // 2] = ChunkStorageMetadata(offsets=torch.Size([CHUNKS // 2 + 1, 0]),
                                                     sizes=torch.Size([1, 1]))
    start = time.perf_counter()
    with pytest.raises(CheckpointError, match=rf"declares the tensor 'w' \[{CHUNKS}, 1\], but "
                                              rf"its {CHUNKS} chunks overlap"):
        check_declared_sizes("ckpt/.metadata", metadata)
    with pytest.raises(CheckpointError, match=rf"the chunks of tensor 'w' \[{CHUNKS}, 1\] in "
                                              r"hf/0\.safetensors, .* and \d+ more files "
                                              r"overlap"):
        _check_coverage("w", entry, metadata, Path("hf"))
    assert time.perf_counter() - start < 2 * SECONDS


def test_a_stored_entry_shorter_than_its_chunk_and_a_compressed_one_are_refused() -> None:
    entry = chunked(4)
    storage = {MetadataIndex("w", list(chunk.offsets)): _Info("__0_0.distcp", 0, 4)
               for chunk in entry.chunks}
    metadata = Metadata(state_dict_metadata={"w": entry},  # type: ignore[dict-item]
                        storage_data=storage)
    check_declared_sizes("m", metadata)
    storage[MetadataIndex("w", [2, 0])] = _Info("__0_0.distcp", 0, 3)
    with pytest.raises(CheckpointError, match=r"its chunk at \[2, 0\] of \[1, 1\] elements "
                                              r"needs 4 bytes and its stored entry holds 3"):
        check_declared_sizes("m", metadata)
    storage[MetadataIndex("w", [2, 0])] = _Info("__0_0.distcp", 0, 4, ["zstd"])
    with pytest.raises(CheckpointError, match=r"its chunk at \[2, 0\] is stored transformed "
                                              r"\(\['zstd'\]\), which dream_trainer never"):
        check_declared_sizes("m", metadata)
    del storage[MetadataIndex("w", [2, 0])]
    with pytest.raises(CheckpointError, match=r"its chunk at \[2, 0\] is stored nowhere"):
        check_declared_sizes("m", metadata)


class _Local:
    """A local directory as ``Files``."""

    def is_file(self, path: Path) -> bool:
        return path.is_file()

    def is_dir(self, path: Path) -> bool:
        return path.is_dir()

    def list_dir(self, path: Path) -> list[tuple[str, bool]]:
        return [(entry.name, entry.is_dir()) for entry in path.iterdir()]

    def read_bytes(self, path: Path) -> bytes:
        return path.read_bytes()

    def open_file(self, path: Path) -> Any:
        return path.open("rb")


def test_a_folder_of_one_element_shards_is_read_and_an_overlapping_one_refused(
        tmp_path: Path) -> None:
    # 2,000 files of one element each, placed by DCP_SHARDING_INFO (what a 10 MB folder
    # holds a hundred times over): read through the reader the loads use.
    count = 2000
    folder = tmp_path / "hf"
    folder.mkdir()
    names = [f"model-{i:05d}-of-{count:05d}.safetensors" for i in range(count)]
    for i, name in enumerate(names):
        save_file({"w": torch.full((1, 1), float(i))}, str(folder / name),
                  metadata={"DCP_SHARDING_INFO": json.dumps({"w": {"saved_offsets": [i, 0]}})})
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"w": names[0]}, "metadata": {}}))
    files: Files = _Local()
    start = time.perf_counter()
    metadata = SliceReader(folder, files).read_metadata()
    assert time.perf_counter() - start < SECONDS
    assert tuple(metadata.state_dict_metadata["w"].size) == (count, 1)
    save_file({"w": torch.zeros(1, 1)}, str(folder / names[-1]),
              metadata={"DCP_SHARDING_INFO": json.dumps({"w": {"saved_offsets": [0, 0]}})})
    with pytest.raises(CheckpointError, match=r"the chunks of tensor 'w' \[1999, 1\] in .* "
                                              r"overlap"):
        SliceReader(folder, files).read_metadata()
    # Moved onto its neighbour instead: the size stays, one element is held twice.
    save_file({"w": torch.zeros(1, 1)}, str(folder / names[-1]),
              metadata={"DCP_SHARDING_INFO": json.dumps({"w": {"saved_offsets": [5, 0]}})})
    save_file({"w": torch.zeros(1, 1)}, str(folder / names[3]),
              metadata={"DCP_SHARDING_INFO": json.dumps({"w": {"saved_offsets": [1999, 0]}})})
    with pytest.raises(CheckpointError, match=r"the chunks of tensor 'w' \[2000, 1\] in .* "
                                              r"overlap"):
        SliceReader(folder, files).read_metadata()


@pytest.mark.parametrize(("shapes", "problem"), [
    ({"m.experts.w1": (10**9, 0, 8), "m.router.weight": (0, 8)},
     r"m\.experts\.w1 \[1000000000, 0, 8\] stacks experts that hold no element"),
    ({"m.experts.w1": (4,), "m.router.weight": (4, 8)},
     r"m\.experts\.w1 \[4\] stacks experts that hold no element"),
    ({"m.experts.w1": (4, 2, 8), "m.experts.w2": (5, 8, 2), "m.router.weight": (4, 8)},
     r"the stacked expert tensors of m differ in their number of experts "
     r"\(\{'m\.experts\.w1': 4, 'm\.experts\.w2': 5\}\)"),
    ({"b.experts.gate_up_proj": (10**9, 4, 0), "b.experts.down_proj": (10**9, 0, 2)},
     r"b\.experts\.gate_up_proj \[1000000000, 4, 0\] stacks experts that hold no element"),
])
def test_stacked_experts_without_elements_or_disagreeing_are_refused_at_once(
        shapes: dict[str, tuple[int, ...]], problem: str) -> None:
    from dream_trainer.weights.stacked import checkpoint_rules

    start = time.perf_counter()
    with pytest.raises(ValueError, match=problem):
        checkpoint_rules(shapes, "mixtral")
    assert time.perf_counter() - start < 1.0
    # Honest ones still give one rule per expert.
    rules = checkpoint_rules({"m.experts.w1": (2, 3, 4), "m.experts.w2": (2, 4, 3),
                              "m.experts.w3": (2, 3, 4), "m.router.weight": (2, 4)}, "mixtral")
    assert len(rules["m.experts.w1"].parts) == 2
