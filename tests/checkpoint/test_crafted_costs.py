"""A crafted checkpoint costs what its bytes cost: memo references that expand a kilobyte
into 2**64 values, a zip record that claims a huge member, one storage named by hundreds of
tensors and views stretched with stride 0 are refused (or read once) within seconds and
megabytes, on every path that reads a checkpoint (resume, ``init_weights_from``, export)."""

from __future__ import annotations

import io
import json
import pickle
import re
import time
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from dream_trainer.checkpoint.budget import BASE_VALUES, EXPANSION, MAX_DEPTH
from dream_trainer.checkpoint.directory import CONFIG, METADATA
from dream_trainer.checkpoint.safe_pickle import loads
from dream_trainer.checkpoint.state import join_tensors, unpack
from dream_trainer.checkpoint.torch_archive import VIEW_BASE, VIEW_MULTIPLE, load_archive
from dream_trainer.errors import CheckpointError
from tests.helpers.crafted import (claims_more_than_it_holds, dag_key, deep_config,
                                   measure_reads, one_epoch_checkpoint, packed, rechecksum,
                                   replace_stored, shared_lists, stored, tensor_index,
                                   with_packed_extra)

SECONDS = 5.0
"""Most a crafted read may take (each is refused in milliseconds; unbounded, they would take
hours or forever)."""
MEMORY_MULTIPLE = 8
MEMORY_CONSTANT = 64 << 20
"""Most a read may grow the process's peak memory: ``MEMORY_MULTIPLE`` x the crafted file's
bytes + ``MEMORY_CONSTANT`` (a trainer's own allocations vary by a few MB between runs).
Unbounded, the inputs below allocate 768 MiB and 1.5 GiB."""
EXPANDS = r"it holds values that expand to more than \d+ objects from \d+ bytes"
VIEWS = r"it holds tensor views of more than \d+ bytes from an archive of \d+ bytes"


def expanding_refusal(size: int) -> str:
    return (f"it holds values that expand to more than {EXPANSION * size + BASE_VALUES} "
            rf"objects from {size} bytes \({EXPANSION} per byte \+ {BASE_VALUES}\)")


# -- the decoder ----------------------------------------------------------------------------
def test_a_key_of_shared_tuples_is_refused_before_it_is_hashed() -> None:
    crafted = dag_key(64) + pickle.dumps(None, protocol=2)[2:]
    assert len(crafted) < 200
    # A stock unpickler hashes all 2**depth values: 16 levels already cost 65,536 visits.
    start = time.perf_counter()
    for kind in ("metadata", "item"):
        with pytest.raises(CheckpointError, match=f"meta cannot be read safely: "
                                                  f"{expanding_refusal(len(crafted))}: shared "
                                                  "references crafted to make reading it "
                                                  "take hours"):
            loads(crafted, "meta", kind)
    assert time.perf_counter() - start < SECONDS


def test_shared_lists_and_sets_of_shared_tuples_are_refused() -> None:
    lists = packed(shared_lists(40))
    assert len(lists) < 2000
    with pytest.raises(CheckpointError, match=f"item cannot be read safely: {EXPANDS}"):
        load_archive(lists, "item")
    tuples: Any = 0
    for _ in range(16):  # 65,536 values: enough to pass the budget, quick to build here
        tuples = (tuples, tuples)
    # A set is built by REDUCE (builtins.set of a list); the builder hashes every member.
    with pytest.raises(CheckpointError, match=EXPANDS):
        load_archive(packed({tuples}), "item")
    with pytest.raises(CheckpointError, match=EXPANDS):
        load_archive(packed(frozenset({tuples})), "item")


def test_a_metadata_that_shares_one_chunk_list_among_many_keys_is_refused() -> None:
    # One TensorStorageMetadata named by 3,000 keys: every builder copies its 3,000 chunks.
    from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, Metadata,
                                                       TensorProperties,
                                                       TensorStorageMetadata)

    chunks = [ChunkStorageMetadata(torch.Size([i]), torch.Size([1])) for i in range(3000)]
    tensor = TensorStorageMetadata(TensorProperties(dtype=torch.float32),
                                   torch.Size([3000]), chunks)
    crafted = pickle.dumps(Metadata({f"w{i}": tensor for i in range(3000)}))
    with pytest.raises(CheckpointError, match=EXPANDS):
        loads(crafted, "meta")
    honest = pickle.dumps(Metadata({f"w{i}": TensorStorageMetadata(
        TensorProperties(dtype=torch.float32), torch.Size([3]), chunks[:3]) for i in range(3000)}))
    assert len(loads(honest, "meta").state_dict_metadata) == 3000


def test_a_cycle_is_refused() -> None:
    cycle: list[Any] = []
    cycle.append(cycle)
    loop: dict[str, Any] = {}
    loop["self"] = [loop]
    for value in (cycle, loop):
        with pytest.raises(CheckpointError, match=f"nested more than {MAX_DEPTH} deep \\(or a "
                                                  "container that holds itself\\)"):
            load_archive(packed(value), "item")


def test_honest_sharing_still_loads() -> None:
    # A small tuple named 10,000 times expands to 40,000 values from 20 kB: 2 per byte.
    shared = (1, 2.5, "three")
    value = {"history": [shared] * 10_000, "pair": [[shared, shared]] * 100}
    decoded = load_archive(packed(value), "item")
    assert decoded == value and decoded["history"][0] is decoded["history"][9_999]


def test_archive_members_are_checked_against_the_archive_before_they_are_read() -> None:
    crafted = claims_more_than_it_holds(768 << 20)
    assert len(crafted) < 1024
    with pytest.raises(CheckpointError, match=f"item cannot be read safely: it holds a member "
                                              f"'archive/data/0' of {768 << 20} bytes where "
                                              f"the archive of {len(crafted)} bytes"):
        load_archive(crafted, "item")
    honest, out = packed(torch.arange(4.0)), io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(honest)) as source, \
            zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as target:
        for name in source.namelist():
            target.writestr(name, source.read(name))
    with pytest.raises(CheckpointError, match="it holds a compressed member '.*data.pkl' "
                                              r"\(torch.save stores its members uncompressed"):
        load_archive(out.getvalue(), "item")


def test_a_storage_named_by_many_tensors_is_read_once_and_views_are_bounded() -> None:
    base = torch.arange(512 * 1024, dtype=torch.float32)  # 2 MiB
    rows = [base[i * 682:(i + 1) * 682] for i in range(768)]
    decoded = load_archive(packed(rows), "item")
    assert all(torch.equal(got, want) for got, want in zip(decoded, rows))
    # One storage shared by every view, as torch.load gives it.
    assert len({row.untyped_storage().data_ptr() for row in decoded}) == 1

    whole = packed([base[:] for _ in range(768)])  # 1.5 GiB of views of 2 MiB
    limit = VIEW_MULTIPLE * len(whole) + VIEW_BASE
    with pytest.raises(CheckpointError, match=f"tensor views of more than {limit} bytes from "
                                              f"an archive of {len(whole)} bytes"):
        load_archive(whole, "item")
    stretched = packed(torch.zeros(1).expand(2**28))  # 1 GiB of one float
    with pytest.raises(CheckpointError, match=VIEWS):
        load_archive(stretched, "item")
    small = torch.zeros(()).expand(1000, 100)  # a broadcast scalar, saved as it is
    assert torch.equal(load_archive(packed(small), "item"), small)


def _below(frames: int, call: Callable[[], Any]) -> Any:
    return call() if frames == 0 else _below(frames - 1, call)


def test_a_deep_legal_state_unpacks_and_joins_below_a_deep_caller() -> None:
    from dream_trainer.checkpoint.state import TensorRef

    nested: Any = [TensorRef("w")]  # the reference counts as a level: MAX_DEPTH in all
    for _ in range(MAX_DEPTH - 2):
        nested = [nested]
    blob = packed(nested)
    # 600 frames below the read (a trainer's hooks, DCP): a recursive copy of 254 levels
    # at 2 frames each would pass the interpreter's limit of 1,000.
    joined = _below(600, lambda: join_tensors(unpack(blob, torch.device("cpu"), "blob"),
                                              {"w": torch.ones(1)}))
    for _ in range(MAX_DEPTH - 2):
        joined = joined[0]
    assert torch.equal(joined[0], torch.ones(1))


# -- every entry point, measured in one process ---------------------------------------------
@pytest.fixture(scope="module")
def clean(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return one_epoch_checkpoint(tmp_path_factory.mktemp("clean"))


def _dag_metadata(checkpoint: Path) -> int:
    crafted = dag_key(64) + (checkpoint / METADATA).read_bytes()
    (checkpoint / METADATA).write_bytes(crafted)
    rechecksum(checkpoint)
    return len(crafted)


def _deep_config(checkpoint: Path) -> int:
    # The 164 KB config.json whose diff on resume cost 1.5 GiB (every leaf's dotted name as
    # long as the file): read and diffed in linear memory, the resume goes on.
    text = json.dumps(deep_config(depth=900, leaves=150, key="k" * 150))
    (checkpoint / CONFIG).write_text(text)
    rechecksum(checkpoint)
    return len(text)


def _in_weight(blob: bytes) -> Callable[[Path], int]:
    def craft(checkpoint: Path) -> int:
        replace_stored(checkpoint, tensor_index(checkpoint), blob)
        return len(blob)
    return craft


def _in_packed_state(**extra: Any) -> Callable[[Path], int]:
    def craft(checkpoint: Path) -> int:
        with_packed_extra(checkpoint, **extra)
        return len(stored(checkpoint, "state.objects"))
    return craft


_BASE = torch.arange(512 * 1024, dtype=torch.float32)  # one 2 MiB storage
INPUTS: dict[str, tuple[Callable[[Path], int], tuple[str, ...], str | None]] = {
    # name: (craft -> crafted bytes, entry points, refusal or None for a load)
    "honest": (lambda checkpoint: 0, ("resume", "init", "export"), None),
    "dag_key": (_dag_metadata, ("resume", "init", "export"),
                rf"step_10/\.metadata cannot be read safely: {EXPANDS}"),
    "claimed_member": (_in_weight(claims_more_than_it_holds(768 << 20)),
                       ("resume", "init", "export"),
                       rf"\(item state\.models\.\S+\) cannot be read safely: it holds a member "
                       rf"'archive/data/0' of {768 << 20} bytes where the archive of"),
    "deep_config": (_deep_config, ("resume",), None),
    "shared_lists": (_in_packed_state(log=shared_lists(40)), ("resume",),
                     rf"\(item state\.objects\) cannot be read safely: {EXPANDS}"),
    "rows_of_one_storage": (_in_packed_state(rows=[_BASE[i * 682:(i + 1) * 682]
                                                   for i in range(768)]), ("resume",), None),
    "full_views": (_in_packed_state(views=[_BASE[:] for _ in range(768)]), ("resume",),
                   rf"\(item state\.objects\) cannot be read safely: {VIEWS}"),
    "stride_zero": (_in_packed_state(stretched=torch.zeros(1).expand(2**28)), ("resume",),
                    rf"\(item state\.objects\) cannot be read safely: {VIEWS}"),
    "stride_zero_weight": (_in_weight(packed(torch.zeros(1).expand(2**28))),
                           ("resume", "init", "export"),
                           rf"\(item state\.models\.\S+\) cannot be read safely: {VIEWS}"),
}


@pytest.fixture(scope="module")
def costs(clean: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return measure_reads(INPUTS, clean, tmp_path_factory.mktemp("crafted"), "honest/export")


@pytest.mark.parametrize("case", [f"{name}/{entry}" for name, (_, entries, _) in INPUTS.items()
                                  if name != "honest" for entry in entries])
def test_each_crafted_input_costs_what_its_bytes_cost(costs: dict[str, Any],
                                                      case: str) -> None:
    measured = costs[case]
    expected = INPUTS[case.split("/")[0]][2]
    if expected is None:
        assert measured["error"] is None
    else:
        assert measured["error"] is not None, f"{case} was read"
        # Every entry point raises dream_trainer's error, not DCP's CheckpointException.
        assert measured["error"].startswith("CheckpointError: "), measured["error"]
        assert re.search(expected, measured["error"]), measured["error"]
    assert measured["seconds"] < SECONDS
    # The peak only grows: bounding it after this case bounds every case before it too.
    assert measured["peak"] - costs["warm"] <= MEMORY_MULTIPLE * measured["size"] \
        + MEMORY_CONSTANT, (measured["peak"] - costs["warm"]) / 2**20
