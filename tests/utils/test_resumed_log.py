"""``Continuation``: what a run resumed at a step keeps of a log file, and which keys of that
step it replaces."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from dream_trainer.utils.resumed_log import Continuation

# As the CSV logger reads them (strings, empty cells) and as the JSONL logger does.
CSV_ROWS = [{"step": "9", "loss": "0.9", "val_loss": ""},
            {"step": "10", "loss": "1.0", "val_loss": ""},
            {"step": "10", "loss": "", "val_loss": "0.5"},
            {"step": "11", "loss": "1.1", "val_loss": ""}]
JSON_ROWS = [{"step": 9, "loss": 0.9}, {"step": 10, "loss": 1.0}, {"step": 10, "val_loss": 0.5},
             {"step": 11, "loss": 1.1}]


@pytest.mark.parametrize("rows", [CSV_ROWS, JSON_ROWS], ids=["csv", "jsonl"])
def test_rows_past_the_resumed_step_are_dropped_and_a_key_logged_again_replaced(
        rows: list[dict[str, object]]) -> None:
    continuation = Continuation(Path("metrics"), 10, rows)
    assert continuation.rows == rows[:3] and continuation.dropped == 1
    assert not continuation.done
    # The resumed run validates again at step 10: the earlier val_loss of step 10 goes, and
    # the row that held only it.
    assert continuation.repeated(10, ["val_loss", "val_acc"]) == {"val_loss"}
    assert continuation.without(continuation.rows, {"val_loss"}) == rows[:2]
    assert continuation.repeated(10, ["val_loss"]) == set()  # its own row now
    assert not continuation.done  # loss of step 10 might still come again
    assert continuation.repeated(11, ["loss"]) == set()
    assert continuation.done


def test_a_key_shared_with_other_keys_of_the_step_leaves_them() -> None:
    rows = [{"step": 10, "loss": 1.0, "val_loss": 0.5, "lr": 0.1}]
    continuation = Continuation(Path("metrics"), 10, rows)
    assert continuation.repeated(10, ["val_loss"]) == {"val_loss"}
    assert continuation.without(rows, {"val_loss"}) == [{"step": 10, "loss": 1.0, "lr": 0.1}]


def test_nothing_to_do_when_the_file_ends_at_the_resumed_step() -> None:
    continuation = Continuation(Path("metrics"), 12, JSON_ROWS)
    assert continuation.rows == JSON_ROWS and continuation.dropped == 0
    assert continuation.done  # nothing was logged at step 12


def test_an_unreadable_row_is_dropped_with_a_warning_naming_the_file(
        caplog: pytest.LogCaptureFixture) -> None:
    rows = [{"step": 1, "loss": 1.0}, None, {"step": "x", "loss": 2.0}, {"loss": 3.0}]
    with caplog.at_level(logging.WARNING, logger="dream_trainer"):
        continuation = Continuation(Path("logs/metrics.jsonl"), 5, rows)
    assert continuation.rows == rows[:1] and continuation.dropped == 3
    assert [record.getMessage() for record in caplog.records] == [
        f"dropping row {number} of logs/metrics.jsonl: it has no step (a write the "
        "interruption cut short)" for number in (2, 3, 4)]
