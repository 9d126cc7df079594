"""The checkpoint decoder: it gives back what torch and DCP wrote, and refuses every way a
crafted pickle reaches code or state (BUILD on a class, calls, colliding keys, deep nesting,
tensor views outside their storage)."""

from __future__ import annotations

import collections
import io
import pathlib
import pickle
import struct
import subprocess
import sys
import time
import zipfile
from typing import Any, NamedTuple

import pytest
import torch

from dream_trainer.checkpoint.safe_pickle import MAX_DEPTH, loads
from dream_trainer.checkpoint.torch_archive import load_archive
from dream_trainer.errors import CheckpointError
from dream_trainer.utils.hash_guard import MAX_SHARED_HASH, HashFloodError, check_key_spread
from tests.helpers.launch import REPO, child_env

P = 2**61 - 1  # ints that differ by a multiple of it share their hash


class Point(NamedTuple):
    x: int
    y: float


def saved(value: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def text(value: str) -> bytes:
    """A BINUNICODE opcode."""
    raw = value.encode()
    return b"X" + struct.pack("<I", len(raw)) + raw


def build_on(module: str, name: str, attributes: dict[str, str]) -> bytes:
    """Opcodes that push the class ``module.name`` and BUILD it with ``attributes`` (as slot
    state), then drop it: prepended to a pickle, they change the class and let the rest load."""
    state = b"}" + b"".join(text(key) + text(value) + b"s" for key, value in attributes.items())
    return b"\x80\x02c" + f"{module}\n{name}\n".encode() + b"N" + state + b"\x86b0"


def dcp_metadata() -> Any:
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (BytesStorageMetadata,
                                                       ChunkStorageMetadata, Metadata,
                                                       MetadataIndex, StorageMeta,
                                                       TensorProperties, TensorStorageMetadata)

    chunks = [ChunkStorageMetadata(torch.Size([0, 0]), torch.Size([2, 4])),
              ChunkStorageMetadata(torch.Size([2, 0]), torch.Size([2, 4]))]
    tensor = TensorStorageMetadata(TensorProperties(dtype=torch.bfloat16,
                                                    memory_format=torch.channels_last),
                                   torch.Size([4, 4]), chunks)
    storage = {MetadataIndex("w", torch.Size([0, 0]), 0): _StorageInfo("__0_0.distcp", 0, 64),
               MetadataIndex("w", torch.Size([2, 0]), 1): _StorageInfo("__1_0.distcp", 0, 64),
               MetadataIndex("step"): _StorageInfo("__0_0.distcp", 64, 700)}
    return Metadata({"w": tensor, "step": BytesStorageMetadata()},
                    planner_data={"w": ("w",), "step": ("state", "step")},
                    storage_data=storage,
                    storage_meta=StorageMeta(checkpoint_id=pathlib.Path("/ckpt/step_1"),
                                             save_id="abc", modules=["m"]))


def rezipped(archive: bytes, edit: Any) -> bytes:
    """``archive`` with its data.pkl replaced by ``edit(data.pkl)``, as an attacker would."""
    source, out = zipfile.ZipFile(io.BytesIO(archive)), io.BytesIO()
    with zipfile.ZipFile(out, "w") as target:
        for name in source.namelist():
            data = source.read(name)
            target.writestr(name, edit(data) if name.endswith("data.pkl") else data)
    return out.getvalue()


# -- what is written, read back ------------------------------------------------------------
def test_dcp_metadata_reads_back_equal_as_fresh_objects() -> None:
    metadata = dcp_metadata()
    decoded = loads(pickle.dumps(metadata), "meta")
    assert decoded == metadata
    assert decoded.state_dict_metadata["w"].properties.memory_format == torch.channels_last
    assert decoded.storage_meta.checkpoint_id == pathlib.PurePosixPath("/ckpt/step_1")
    # Built by the decoder, not shared with anything the pickle could reach later.
    assert decoded.storage_data is not metadata.storage_data


def test_torch_save_archives_read_back_exactly() -> None:
    base = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    value = {
        "tensors": [base, base[:, 1], base.t(), torch.empty(0, 3),
                    torch.arange(5).to(torch.uint16), torch.ones(2).to(torch.float8_e4m3fn),
                    torch.nn.Parameter(torch.ones(2))],
        "plain": (1, 2.5, "s", b"raw", bytearray(b"ba"), None, True, 1 + 2j, -(2**70)),
        "torch": (torch.Size([2, 3]), torch.float16, torch.device("cpu")),
        "ordered": collections.OrderedDict([(3, "c"), (1, "a")]),
        "sets": ({1, 2}, frozenset({"a"})),
        "int_keys": {0: {"step": torch.tensor(4.0)}, 1: {}},
    }
    decoded = load_archive(saved(value), "item")
    for got, want in zip(decoded["tensors"], value["tensors"]):
        assert got.dtype == want.dtype and got.shape == want.shape
        assert torch.equal(got.float(), want.float())
    assert isinstance(decoded["tensors"][-1], torch.nn.Parameter)
    assert decoded["plain"] == value["plain"] and decoded["torch"] == value["torch"]
    assert type(decoded["ordered"]) is collections.OrderedDict
    assert list(decoded["ordered"]) == [3, 1]
    assert decoded["sets"] == value["sets"] and decoded["int_keys"] == value["int_keys"]


def test_a_trusted_type_unpickles_the_standard_way_and_others_are_named() -> None:
    data = saved({"p": Point(1, 2.0)})
    name = f"{__name__}.Point"
    with pytest.raises(CheckpointError, match=rf"item would unpickle {name}, which is not an "
                                              r"allowed type.*trusted_globals=\['" + name):
        load_archive(data, "item")
    assert load_archive(data, "item", trusted={name: Point}) == {"p": Point(1, 2.0)}


def test_tensors_saved_with_python_state_read_back() -> None:
    # torch.save writes these through torch._tensor._rebuild_from_type_v2: a tensor with
    # attributes, and float8 training's weights (a subclass holding the plain tensor).
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    tagged = torch.arange(3.0)
    tagged.tag = "kept"  # type: ignore[attr-defined]
    decoded = load_archive(saved(tagged), "item")
    assert torch.equal(decoded, tagged) and decoded.tag == "kept"

    model = torch.nn.Sequential(torch.nn.Linear(16, 16))
    convert_to_float8_training(model, config=Float8LinearConfig(
        enable_fsdp_float8_all_gather=True))
    weight = model.state_dict()["0.weight"]
    assert type(weight).__name__ == "WeightWithDynamicFloat8CastTensor"
    decoded = load_archive(saved(weight.detach()), "item")
    assert type(decoded) is torch.Tensor and torch.equal(decoded, model[0].weight._tensor)


class Marked(torch.Tensor):
    """A tensor subclass of the user's: its class would be called to rebuild it."""


def test_a_tensor_subclass_outside_the_list_is_refused() -> None:
    marked = torch.ones(2).as_subclass(Marked)
    with pytest.raises(CheckpointError, match=r"would unpickle .*Marked, which is not an "
                                              "allowed type"):
        load_archive(saved(marked), "item")


def test_map_location_moves_every_tensor() -> None:
    # The meta device stands in for an accelerator: every tensor must land there.
    value = {"a": [torch.ones(2)], "p": Point(1, torch.zeros(1)), "o": collections.OrderedDict(
        t=(torch.ones(1),))}
    moved = load_archive(saved(value), "item", trusted={f"{__name__}.Point": Point},
                         map_location="meta")
    tensors = [moved["a"][0], moved["p"].y, moved["o"]["t"][0]]
    assert all(tensor.device.type == "meta" for tensor in tensors)
    assert type(moved["p"]) is Point and type(moved["o"]) is collections.OrderedDict


# -- attacks --------------------------------------------------------------------------------
def test_build_on_an_allowed_class_changes_every_path_when_unpickled_plainly() -> None:
    # The attack is real: a stock unpickler lets it rewrite a class of the standard library.
    code = ("import pathlib, pickle, sys, torch.distributed.checkpoint\n"
            "pickle.loads(sys.stdin.buffer.read())\n"
            "print(pathlib.PurePosixPath('/home/user/data'))\n")
    crafted = build_on("pathlib", "PurePosixPath", {"_str": "/elsewhere"}) \
        + pickle.dumps(dcp_metadata())
    result = subprocess.run([sys.executable, "-c", code], input=crafted, capture_output=True,
                            env=child_env(), cwd=REPO, timeout=120, check=True)
    assert result.stdout.decode().strip() == "/elsewhere"


@pytest.mark.parametrize("module, name", [
    ("pathlib", "PurePosixPath"),
    ("torch.distributed.checkpoint.metadata", "Metadata"),
    ("torch.distributed.checkpoint.metadata", "_MEM_FORMAT_ENCODING"),
])
def test_build_on_an_allowed_class_is_refused(module: str, name: str) -> None:
    crafted = build_on(module, name, {"_str": "/elsewhere"}) + pickle.dumps(dcp_metadata())
    with pytest.raises(CheckpointError, match=rf"meta cannot be read safely: it holds setting "
                                              rf"the state of {module}\.{name}"):
        loads(crafted, "meta")
    assert str(pathlib.PurePosixPath("/home/user/data")) == "/home/user/data"


def test_build_on_a_class_outside_the_list_is_refused_by_name() -> None:
    crafted = build_on("os", "environ", {"PATH": "/tmp"}) + pickle.dumps(dcp_metadata())
    with pytest.raises(CheckpointError, match="meta would unpickle os.environ, which is not "
                                              "an allowed type"):
        loads(crafted, "meta")


def test_build_on_a_finished_object_and_calls_are_refused() -> None:
    from torch.distributed.checkpoint.metadata import MetadataIndex

    # A MetadataIndex given state a second time, after its builder checked the first.
    again = pickle.dumps(MetadataIndex("w"))[:-1] + b"}" + text("fqn") + b"K\x07sb."
    with pytest.raises(CheckpointError, match="setting the state of a MetadataIndex"):
        loads(again, "meta")
    call = b"\x80\x02ctorch\nSize\n" + b"ctorch\nSize\n" + b"\x85R."  # Size(Size): not ints
    with pytest.raises(CheckpointError, match="torch.Size must be a tuple"):
        loads(call, "meta")
    with pytest.raises(CheckpointError, match=r"a call of a str"):
        loads(b"\x80\x02" + text("x") + b")R.", "meta")


def test_a_relative_path_that_leaves_the_checkpoint_is_refused() -> None:
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import MetadataIndex

    for name in ("../outside.distcp", "/etc/passwd", "sub/__0_0.distcp", "..", ""):
        metadata = dcp_metadata()
        metadata.storage_data[MetadataIndex("x")] = _StorageInfo(name, 0, 1)
        with pytest.raises(CheckpointError, match=r"relative_path .*, which .*: not a file "
                                                  "name inside the checkpoint"):
            loads(pickle.dumps(metadata), "meta")


def colliding_dict(count: int) -> bytes:
    """A pickle of ``{1 + k * P: 0}`` for ``count`` keys, written opcode by opcode: building
    that dict here to pickle it would take this test minutes (the attack itself)."""
    items = b"".join(b"\x8a\x0a" + (1 + k * P).to_bytes(10, "little", signed=True) + b"K\x00"
                     for k in range(count))
    return b"\x80\x02}(" + items + b"u."


def test_colliding_keys_are_refused_within_seconds() -> None:
    # 100,000 distinct int keys with one hash: 1.3 MB, as in the report. Inserted one by one
    # they take minutes (quadratic); counted, they are refused at the 65th.
    flood = colliding_dict(100_000)
    assert len(flood) > 1_300_000
    assert pickle.loads(colliding_dict(200)) == {1 + k * P: 0 for k in range(200)}
    item = rezipped(saved({"rng": {}}), lambda data: flood)
    for read in (lambda: loads(flood, "meta"), lambda: load_archive(item, "item")):
        start = time.perf_counter()
        with pytest.raises(CheckpointError, match=f"more than {MAX_SHARED_HASH} keys of one "
                                                  "dict or set that share a hash"):
            read()
        # Generous: the refusal takes milliseconds; the insert it avoids, minutes.
        assert time.perf_counter() - start < 5


def test_colliding_set_members_and_guard_helper() -> None:
    members = [1 + k * P for k in range(MAX_SHARED_HASH + 1)]
    with pytest.raises(CheckpointError, match="share a hash"):
        load_archive(saved({"s": set(members)}), "item")
    with pytest.raises(HashFloodError, match=f"the state holds more than {MAX_SHARED_HASH} "
                                             "distinct keys with the same hash"):
        check_key_spread(members, "the state")
    check_key_spread(range(100_000), "the state")  # distinct hashes: accepted


def test_nesting_too_deep_to_hash_is_refused_not_a_crash() -> None:
    # 100,000 nested 1-tuples cost 100 kB; hashing them would overflow the C stack.
    deep = b"\x80\x02K\x01" + b"\x85" * 100_000 + b"."
    with pytest.raises(CheckpointError, match=f"nested more than {MAX_DEPTH} deep"):
        loads(deep, "meta")
    nested: list[Any] = []
    for _ in range(MAX_DEPTH + 5):
        nested = [nested]
    with pytest.raises(CheckpointError, match=f"nested more than {MAX_DEPTH} deep"):
        load_archive(saved(nested), "item")


def test_a_tensor_view_outside_its_storage_is_refused() -> None:
    small = saved(torch.arange(4, dtype=torch.float32))
    # The pickle declares a 4-element storage; the size (4,) becomes (400,).
    crafted = rezipped(small, lambda data: data.replace(b"K\x04\x85", b"M\x90\x01\x85", 1))
    assert torch.equal(load_archive(small, "item"), torch.arange(4, dtype=torch.float32))
    with pytest.raises(CheckpointError, match="reaches past its storage of 4 elements"):
        load_archive(crafted, "item")


@pytest.mark.parametrize("opcode", [b"i", b"o", b"\x82", b"\x92"])
def test_opcodes_that_call_or_extend_are_never_allowed(opcode: bytes) -> None:
    with pytest.raises(CheckpointError, match="which is never allowed"):
        loads(b"\x80\x02(" + opcode + b"x\ny\n.", "meta")


def test_damaged_pickles_name_the_source() -> None:
    with pytest.raises(CheckpointError, match="cannot read meta: "):
        loads(b"\x80\x02(", "meta")
    with pytest.raises(CheckpointError, match="item is not a torch.save archive"):
        load_archive(b"not a zip", "item")
    with pytest.raises(CheckpointError, match="where DCP's Metadata belongs"):
        loads(pickle.dumps({"a": 1}), "meta")
