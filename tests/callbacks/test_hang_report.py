"""The hang verdict: printed once before any ended rank exits, and clear errors on bad records."""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from dream_trainer.callbacks.hang_report import (MAX_WORLD_SIZE, read_records, report_once,
                                                 verdict, write_record)
from dream_trainer.cli import main


def end_ranks(directory: Path, ranks_in_order: list[int], world_size: int,
              wait: float) -> list[tuple[str, int, str]]:
    """End ``ranks_in_order`` as their watchdogs would, one thread each, each starting only
    once the one before has written its record; return what happened, in order: ("emit", rank,
    text) when a rank prints the verdict, ("exit", rank, "") when it returns to exit."""
    events: list[tuple[str, int, str]] = []
    lock = threading.Lock()

    def rank_ends(rank: int) -> None:
        def emit(text: str) -> None:
            with lock:
                events.append(("emit", rank, text))

        report_once(directory, "r", rank, world_size, wait, emit)
        with lock:
            events.append(("exit", rank, ""))

    threads = []
    for rank in ranks_in_order:
        write_record(directory, "r", rank, world_size, step=2, epoch=0, stuck=4.0, mesh=None)
        threads.append(threading.Thread(target=rank_ends, args=(rank,)))
        threads[-1].start()
        time.sleep(0.05)
    for thread in threads:
        thread.join(timeout=60)
    return events


@pytest.mark.parametrize("order", [[0, 2, 3, 1], [3, 1, 2, 0], [1, 0, 3, 2]])
def test_one_verdict_is_printed_before_any_rank_exits_whichever_ends_first(
        tmp_path: Path, order: list[int]) -> None:
    # torchrun ends every rank once one exits: the verdict must come before the first exit.
    events = end_ranks(tmp_path, order, world_size=4, wait=30.0)
    assert [kind for kind, _, _ in events] == ["emit"] + ["exit"] * 4, events
    kind, rank, text = events[0]
    assert rank == 0 and text.startswith("hang verdict over 4 of 4 ranks"), events
    assert sorted(rank for _, rank, _ in events[1:]) == [0, 1, 2, 3]


def test_without_rank_zero_the_lowest_rank_with_a_record_prints_it(tmp_path: Path) -> None:
    # Rank 0 never wrote (ended before its watchdog fired): rank 1 prints what there is.
    events = end_ranks(tmp_path, [2, 3, 1], world_size=4, wait=1.0)
    assert [kind for kind, _, _ in events] == ["emit"] + ["exit"] * 3, events
    kind, rank, text = events[0]
    assert rank == 1, events
    assert text.startswith("hang verdict over 3 of 4 ranks (global steps: rank 1: 2, rank 2: "
                           "2, rank 3: 2)\nno record from ranks [0]: they wrote none"), text


def test_a_rank_left_out_of_the_printed_verdict_prints_a_fuller_one(tmp_path: Path) -> None:
    # Rank 1 gave up waiting and printed over its own record; rank 2's came later.
    assert end_ranks(tmp_path, [1], world_size=4, wait=0.0)[0][2].startswith(
        "hang verdict over 1 of 4 ranks")
    events = end_ranks(tmp_path, [2], world_size=4, wait=0.5)
    assert [(kind, rank) for kind, rank, _ in events] == [("emit", 2), ("exit", 2)], events
    assert events[0][2].startswith("hang verdict over 2 of 4 ranks"), events
    assert "no record from ranks [0, 3]" in events[0][2], events


def record(rank: int = 0, world_size: int = 2, **changes: Any) -> dict[str, Any]:
    fields = {"run": "r", "written": 1.0, "rank": rank, "world_size": world_size,
              "global_step": 7, "epoch": 0, "stuck_seconds": 5.0,
              "stack": [{"file": "/job/train.py", "line": 3, "function": "main"}],
              "groups": {}, "recorder": None, "status": {}, "entries": []}
    return {key: value for key, value in {**fields, **changes}.items() if value is not ...}


BAD_RECORDS = {
    "missing field": (record(global_step=...),
                      "(global_step: Field required)"),
    "a trillion ranks": (record(world_size=10**12),
                         f"(world_size: Input should be less than or equal to {MAX_WORLD_SIZE})"),
    "not JSON": ("{ this is not json",
                 "(its content: Invalid JSON: key must be a string at line 1 column 3)"),
    "not an object": ([1, 2], "(its content: Input should be an object)"),
    "a frame without a line": (record(stack=[{"file": "a.py", "function": "f"}]),
                               "(stack.0.line: Field required)"),
    "rank past the world": (record(rank=2), "(rank 2 is not below its world_size 2)"),
}


@pytest.mark.parametrize("case", sorted(BAD_RECORDS))
def test_diagnose_names_the_bad_record_and_what_is_wrong(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], case: str) -> None:
    content, problem = BAD_RECORDS[case]
    (tmp_path / "hang_rank1.json").write_text(json.dumps(record(rank=1)))
    bad = tmp_path / "hang_rank0.json"
    bad.write_text(content if isinstance(content, str) else json.dumps(content))
    with pytest.raises(ValueError) as raised:
        read_records(tmp_path)
    assert str(raised.value) == (f"{bad} is not a hang record as HangWatchdog writes it "
                                 f"{problem}: move it out of the directory to judge from the "
                                 "other records")
    assert main(["diagnose", str(tmp_path)]) == 1
    out, err = capsys.readouterr()
    assert out == "" and err == f"dream-trainer diagnose: error: {raised.value}\n"


def test_diagnose_refuses_disagreeing_sizes_no_records_and_unreadable_files(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "hang_rank0.json").write_text(json.dumps(record(rank=0, world_size=2)))
    (tmp_path / "hang_rank1.json").write_text(json.dumps(record(rank=1, world_size=8)))
    assert main(["diagnose", str(tmp_path)]) == 1
    assert capsys.readouterr().err == (
        f"dream-trainer diagnose: error: the records of run 'r' in {tmp_path} disagree on its "
        "world size (hang_rank0.json says 2, hang_rank1.json says 8): move the records of "
        "other runs out of it\n")
    assert main(["diagnose", str(tmp_path / "nothing")]) == 1
    assert "no hang_rank<R>.json in" in capsys.readouterr().err
    # A record that never ends (a device) or blocks (a FIFO) is refused unread.
    (tmp_path / "hang_rank1.json").unlink()
    (tmp_path / "hang_rank1.json").symlink_to("/dev/zero")
    os.mkfifo(tmp_path / "hang_rank2.json")
    for rank in (1, 2):
        assert main(["diagnose", str(tmp_path)]) == 1
        assert capsys.readouterr().err == (f"dream-trainer diagnose: error: {tmp_path}/"
                                           f"hang_rank{rank}.json cannot be read (not a "
                                           "regular file): move it out of the directory to "
                                           "judge from the other records\n")
        (tmp_path / f"hang_rank{rank}.json").unlink()


def test_many_missing_ranks_are_named_as_spans(tmp_path: Path) -> None:
    for rank in (3, 5, 6):
        (tmp_path / f"hang_rank{rank}.json").write_text(
            json.dumps(record(rank=rank, world_size=MAX_WORLD_SIZE)))
    text = verdict(read_records(tmp_path))
    assert text.splitlines()[1] == (f"no record from ranks [0-2, 4, 7-{MAX_WORLD_SIZE - 1}]: "
                                    "they wrote none (killed first, or their files are on "
                                    "another machine's disk)")
