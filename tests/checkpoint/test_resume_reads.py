"""Resuming FSDP2 on 2 ranks: each rank reads only its own shards, and no full tensor is
gathered (issue 26, item 3)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from dream_trainer.checkpoint.trust import safe_reader
from tests.helpers.launch import REPO, check, torchrun

pytestmark = pytest.mark.distributed

SCRIPT = REPO / "tests/scripts/resume_reads.py"


def test_each_rank_reads_only_its_shards_and_gathers_nothing(tmp_path: Path) -> None:
    check(torchrun(SCRIPT, [str(tmp_path / "root"), str(tmp_path / "out")]))
    records = [json.loads(Path(f"{tmp_path / 'out'}.rank{rank}").read_text())
               for rank in (0, 1)]
    loaded = tmp_path / "root/reads/tests/run/checkpoints/step_1"
    metadata = safe_reader(str(loaded)).read_metadata()
    # Every tensor split over the two ranks: weights, biases and both AdamW moments.
    chunks = {(fqn, tuple(chunk.offsets)): tuple(chunk.sizes)
              for fqn, meta in metadata.state_dict_metadata.items()
              if isinstance(meta, TensorStorageMetadata) and len(meta.chunks) == 2
              for chunk in meta.chunks}
    assert len(chunks) == 2 * 4 * 3
    sharded_bytes = sum(info.length for index, info in metadata.storage_data.items()
                        if (index.fqn, tuple(index.offset or ())) in chunks)

    read_by: dict[tuple[str, tuple[int, ...]], list[int]] = {}
    for rank, record in enumerate(records):
        mine = [read for read in record["reads"]
                if (read["fqn"], tuple(read["chunk"])) in chunks]
        for read in mine:
            key = (read["fqn"], tuple(read["chunk"]))
            read_by.setdefault(key, []).append(rank)
            # The whole saved chunk is what this rank holds: nothing is read to be dropped.
            assert tuple(read["lengths"]) == chunks[key], read
        assert sum(read["file_bytes"] for read in mine) == sharded_bytes // 2
        # The rest (AdamW's step counts, hyperparameters, loop counters, blobs) is small.
        rest = sum(read["file_bytes"] for read in record["reads"] if read not in mine)
        assert rest < 0.05 * sharded_bytes, rest
        # DCP's collectives carry read plans, not tensors: a gathered full state dict
        # would pass at least the other rank's half through them.
        assert record["collective_bytes"] < 0.02 * sharded_bytes, record["collective_calls"]
        assert not any("all_gather_into_tensor" in name for name in record["collective_calls"])
    # Each rank checksums the data files it wrote (and, resuming in the same layout, reads):
    # verifying step_1 and committing step_2 read no other rank's data.
    checksummed = [record["checksummed"] for record in records]
    for step in ("step_1", "step_2"):
        shares = [[name for name in names if name.startswith(f"{step}/")]
                  for names in checksummed]
        assert sorted(shares[0] + shares[1]) == sorted(
            f"{step}/{name}" for name in ("__0_0.distcp", "__1_0.distcp", ".metadata",
                                          "config.json")), shares
        for rank, share in enumerate(shares):
            assert [name for name in share if name.endswith(".distcp")] \
                == [f"{step}/__{rank}_0.distcp"]
    for rank, record in enumerate(records):
        assert {read["file"] for read in record["reads"]
                if (read["fqn"], tuple(read["chunk"])) in chunks} == {f"__{rank}_0.distcp"}
    assert set(read_by) == set(chunks)  # every shard is read, each by exactly one rank
    assert all(len(ranks) == 1 for ranks in read_by.values())
    assert {ranks[0] for ranks in read_by.values()} == {0, 1}
