"""Inputs a run reads from files anyone may write cost what their bytes cost and print
nothing a terminal acts on: every JSON file is bounded before it is parsed, the config diff
and the hang verdict are linear in their input, and names from a file are printed escaped."""

from __future__ import annotations

import json
import os
import pickle
import shutil
import time
import tracemalloc
from pathlib import Path
from typing import Any

import pytest

from dream_trainer.callbacks.hang_report import MAX_RECORD_BYTES, read_records, verdict
from dream_trainer.checkpoint.agreement import MAX_CHANGES_SHOWN, config_changes, saved_config
from dream_trainer.checkpoint.directory import INFO, METADATA, CheckpointInfo, checksum
from dream_trainer.checkpoint.storage import LocalStorage
from dream_trainer.cli import main
from dream_trainer.errors import CheckpointError
from dream_trainer.utils.bounded import MAX_INDEX_BYTES, MAX_JSON_BYTES
from dream_trainer.utils.paths import component_problem
from dream_trainer.utils.text import printable
from dream_trainer.weights.hf import check_hf_dir
from tests.helpers.crafted import deep_config, one_epoch_checkpoint

SECONDS = 5.0
"""Most a crafted input may take (each is handled in well under a second; the quadratic
versions took minutes to hours)."""
ESCAPES = "\x1b]0;owned\x07\x1b[2J"
"""Retitles the terminal's window and clears its screen when printed raw."""


def oversized(path: Path, size: int) -> None:
    """Make ``path`` a file of ``size`` bytes (sparse: the size is what is checked first)."""
    with path.open("wb") as file:
        file.truncate(size)


# -- every JSON file is bounded -----------------------------------------------------------------
@pytest.fixture(scope="module")
def clean(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return one_epoch_checkpoint(tmp_path_factory.mktemp("run"))


def limit_message(path: Path, size: int, limit: int) -> str:
    return (f"{path} holds {size} bytes, more than the {limit} bytes ({limit / 2**20:g} MiB) "
            "read of a file of its kind")


def test_an_oversized_checkpoint_json_is_refused_naming_its_size_and_the_limit(
        clean: Path, tmp_path: Path) -> None:
    checkpoint = tmp_path / "step_10"
    shutil.copytree(clean, checkpoint)
    size = MAX_JSON_BYTES + 1
    oversized(checkpoint / "config.json", size)
    with pytest.raises(CheckpointError) as error:
        saved_config(checkpoint)
    assert limit_message(checkpoint / "config.json", size, MAX_JSON_BYTES) in str(error.value)
    oversized(checkpoint / INFO, size)
    with pytest.raises(CheckpointError) as error:
        CheckpointInfo.read(checkpoint)
    assert limit_message(checkpoint / INFO, size, MAX_JSON_BYTES) in str(error.value)
    # At the limit, a file is read as before.
    shutil.copy(clean / INFO, checkpoint / INFO)
    record = (clean / INFO).read_bytes()
    (checkpoint / INFO).write_bytes(record + b" " * (MAX_JSON_BYTES - len(record)))
    assert CheckpointInfo.read(checkpoint).step == 10


def test_an_oversized_safetensors_index_is_refused(tmp_path: Path) -> None:
    (tmp_path / "model-00001-of-00001.safetensors").write_bytes(b"")
    index = tmp_path / "model.safetensors.index.json"
    oversized(index, MAX_INDEX_BYTES + 5)
    with pytest.raises(CheckpointError) as error:
        check_hf_dir(tmp_path, LocalStorage())
    assert f"{index} cannot be read as a safetensors index: ValueError: " + limit_message(
        index, MAX_INDEX_BYTES + 5, MAX_INDEX_BYTES) in str(error.value)


def test_an_oversized_hang_record_is_refused_unread(tmp_path: Path) -> None:
    record = tmp_path / "hang_rank0.json"
    oversized(record, MAX_RECORD_BYTES + 1)
    with pytest.raises(ValueError) as error:
        read_records(tmp_path)
    assert str(error.value) == (
        f"{record} cannot be read (it holds {MAX_RECORD_BYTES + 1} bytes, more than the "
        f"{MAX_RECORD_BYTES} bytes (64 MiB) read of a file of its kind: real ones are far "
        "smaller, so it was altered or is not such a file): move it out of the directory to "
        "judge from the other records")


# -- the config diff is linear ------------------------------------------------------------------
def test_a_deep_config_json_is_diffed_in_linear_memory_and_listed_capped() -> None:
    saved = deep_config(depth=900, leaves=150, key="k" * 150)
    text = json.dumps(saved)
    assert 160_000 < len(text) < 170_000  # the 164 KB that cost 1.5 GiB
    tracemalloc.start()
    start = time.perf_counter()
    changes = config_changes(saved, json.dumps({"lr": 0.5}))
    seconds = time.perf_counter() - start
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert seconds < SECONDS
    # Stated bound: 20 times the file plus 4 MiB (the walk's stack and the lines shown);
    # joining every leaf's name needs hundreds of MiB.
    assert peak < 20 * len(text) + (4 << 20), peak
    total = 900 * 3 + 150 + 1
    assert len(changes) == MAX_CHANGES_SHOWN + 1
    assert changes[-1] == f"... and {total - MAX_CHANGES_SHOWN} more changes"
    assert all(len(line) < 1000 for line in changes)
    assert changes[-2].startswith("<") and " levels>." in changes[-2]
    # Names of ordinary length read in full, and an escape in a key is shown escaped.
    assert config_changes({"a": {"b": 1}, "lr": 0.01, f"x{ESCAPES}": 1},
                          json.dumps({"a": {"b": 2}, "lr": 0.5})) == [
        "a.b: 1 -> 2", "lr: 0.01 -> 0.5",
        f"{printable(f'x{ESCAPES}')}: 1 -> '<absent>'"]


# -- the hang verdict is linear and escaped -----------------------------------------------------
def record(rank: int, **changes: Any) -> dict[str, Any]:
    fields = {"run": "r", "written": 1.0, "rank": rank, "world_size": 2, "global_step": 7,
              "epoch": 0, "stuck_seconds": 5.0,
              "stack": [{"file": "/job/train.py", "line": 3, "function": "main"}],
              "groups": {}, "recorder": None, "status": {}, "entries": []}
    return {**fields, **changes}


def test_diagnose_of_many_groups_and_collectives_is_linear(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # 20,000 groups where rank 0 is one collective ahead, and 20,000 recorded collectives
    # of another group: looking up each group's collective among all of them is 4*10^8
    # steps (minutes); an index makes it 40,000.
    count = 20_000
    names = [f"g{i}" for i in range(count)]
    entries = [{"group": "other", "sequence": i, "op": "all_reduce", "sizes": None,
                "finished": True, "created_ns": i + 1} for i in range(count)]
    entries.append({"group": "g7", "sequence": 5, "op": "broadcast", "sizes": None,
                    "finished": False, "created_ns": 1})
    (tmp_path / "hang_rank0.json").write_text(json.dumps(record(
        0, status={name: {"enqueued": 5, "completed": 4} for name in names},
        entries=entries)))
    (tmp_path / "hang_rank1.json").write_text(json.dumps(record(
        1, status={name: {"enqueued": 4, "completed": 4} for name in names},
        stack=[{"file": "/job/train.py", "line": 9, "function": f"step{ESCAPES}"}])))
    start = time.perf_counter()
    assert main(["diagnose", str(tmp_path)]) == 0
    assert time.perf_counter() - start < SECONDS
    out = capsys.readouterr().out
    # g0 and every other group's collective #5 is unrecorded (created 0, the earliest): the
    # first in name order is named; g7's recorded one was created later.
    assert out.splitlines()[1] == ("ranks [0] entered collective #5 on process group g0 "
                                   "(process group g0); ranks [1] never did")
    assert "\x1b" not in out and "\x07" not in out
    assert out.splitlines()[2] == (r"rank 1 never entered collective #5 on process group g0; "
                                   r"it is at train.py:9 in step\x1b]0;owned\x07\x1b[2J")


def test_the_verdict_names_the_recorded_collective_and_escapes_what_it_quotes() -> None:
    group = f"g{ESCAPES}"
    records = {
        0: record(0, status={group: {"enqueued": 3, "completed": 2}},
                  groups={group: {"axis": f"dp{ESCAPES}", "ranks": [0, 1]}},
                  entries=[{"group": group, "sequence": 3, "op": f"all_gather{ESCAPES}",
                            "sizes": None, "finished": False, "created_ns": 10}]),
        1: record(1, status={group: {"enqueued": 2, "completed": 2}}),
    }
    text = verdict(records)  # type: ignore[arg-type]
    assert "\x1b" not in text and "\x07" not in text
    shown = printable(ESCAPES)
    assert text.splitlines()[1] == (f"ranks [0] entered all_gather{shown} #3 on dp{shown} "
                                    f"(process group g{shown}); ranks [1] never did")


def test_diagnose_errors_quote_file_names_escaped(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / f"hang_rank{ESCAPES}.json").write_text("{ not json")
    assert main(["diagnose", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert "\x1b" not in err and "\x07" not in err
    assert f"hang_rank{printable(ESCAPES)}.json is not a hang record" in err


# -- names from a checkpoint --------------------------------------------------------------------
def test_a_model_name_with_control_characters_is_refused_and_printed_escaped(
        clean: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    checkpoint = tmp_path / "step_10"
    shutil.copytree(clean, checkpoint)
    metadata = pickle.loads((checkpoint / METADATA).read_bytes())  # our own file: trusted
    model = f"m{ESCAPES}"
    metadata.state_dict_metadata = {
        key.replace("state.models.model.", f"state.models.{model}.", 1): value
        for key, value in metadata.state_dict_metadata.items()}
    metadata.storage_data = {
        type(index)(index.fqn.replace("state.models.model.", f"state.models.{model}.", 1),
                    index.offset, index.index): info
        for index, info in metadata.storage_data.items()}
    (checkpoint / METADATA).write_bytes(pickle.dumps(metadata))
    info = json.loads((checkpoint / INFO).read_text())
    info["files"] = {name: checksum(checkpoint / name) for name in info["files"]}
    (checkpoint / INFO).write_text(json.dumps(info))
    out = tmp_path / "out"
    assert main(["export", str(checkpoint), str(out)]) == 1
    captured = capsys.readouterr()
    printed = captured.out + captured.err
    assert "\x1b" not in printed and "\x07" not in printed
    assert (f"names the model {model!r}, which contains a control character: an export "
            "writes each model to a file named after it") in captured.err
    assert not out.exists() or not os.listdir(out)


@pytest.mark.parametrize(("name", "problem"), [
    ("run\x1b[2J", "contains a control character"),
    ("tab\there", "contains a control character"),
    ("a\0b", "contains a NUL character"),
    ("naïve-ütf8", None),
])
def test_component_names_with_control_characters_are_refused(name: str,
                                                             problem: str | None) -> None:
    assert component_problem(name) == problem


def test_printable_escapes_only_what_a_terminal_acts_on() -> None:
    assert printable("plain name, ünïcode, back\\slash") == "plain name, ünïcode, back\\slash"
    assert printable(f"a{ESCAPES}\u202eb") == r"a\x1b]0;owned\x07\x1b[2J\u202eb"
    assert printable("two\nlines\x1b", keep="\n") == "two\nlines\\x1b"
