"""A log file that a resumed run continues: one row per step and key, as if never interrupted.

A run resumed from the checkpoint of step S logs again what the interrupted run logged after
that checkpoint was taken: every step after S, and, at S itself, what follows a save within
a step (the end of an epoch whose last step was saved: its validation). The
file loggers (``CSVLoggerMixin``, ``JSONLoggerMixin``) open the file through ``Continuation``:
rows past S are dropped, and the first time the resumed run logs a key at S, that key is
removed from the interrupted run's rows of S. Rows are dicts with an integer ``"step"`` (or
its digits, as a CSV cell holds it); a key whose value is ``""`` or ``None`` (an empty CSV
cell) is not in the row.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

Row = dict[str, Any]


class Continuation:
    """The rows of a log file that a run resumed at ``step`` keeps, and the keys at ``step``
    it may still log again.

    Args:
        path: The log file (named in warnings).
        step: The global step the run resumed from.
        rows: The file's rows, in order; a row whose step cannot be read is a write cut short
            by the interruption, and is dropped with a warning.
    """

    def __init__(self, path: Path, step: int, rows: Iterable[Row | None]) -> None:
        self.step = step
        self.rows: list[Row] = []
        self.dropped = 0
        for number, row in enumerate(rows, start=1):
            row_step = _step(row)
            if row is None or row_step is None:
                logger.warning("dropping row %d of %s: it has no step (a write the "
                               "interruption cut short)", number, path)
                self.dropped += 1
            elif row_step > step:
                self.dropped += 1
            else:
                self.rows.append(row)
        self._repeatable = {key for row in self.rows if _step(row) == step
                            for key in _keys(row)}

    def repeated(self, step: int, keys: Iterable[str]) -> set[str]:
        """The ``keys`` of a new row at ``step`` that an earlier row of that step holds (the
        caller then rewrites the file through ``without``); empty once the run is past
        ``step``."""
        if step != self.step:
            self._repeatable.clear()
            return set()
        found = self._repeatable.intersection(keys)
        self._repeatable -= found
        return found

    @classmethod
    def resume(cls, path: Path, step: int, rows: Iterable[Row | None],
               rewrite: Callable[[list[Row]], None]) -> Continuation | None:
        """Drop from the file the rows past ``step`` (through ``rewrite``, when there are
        some); returns the continuation while keys at ``step`` may still repeat, else None."""
        continuation = cls(path, step, rows)
        if continuation.dropped:
            rewrite(continuation.rows)
        return None if continuation.done else continuation

    def settle(self, step: int, keys: Iterable[str], rows: Callable[[], list[Row | None]],
               rewrite: Callable[[list[Row]], None]) -> bool:
        """Before a new row of ``keys`` at ``step``: remove from the file (``rows()`` read, then
        ``rewrite``) the keys an earlier row of that step holds. Returns whether the file
        still needs this continuation."""
        repeated = self.repeated(step, keys)
        if repeated:
            rewrite(self.without(rows(), repeated))
        return not self.done

    @property
    def done(self) -> bool:
        """Whether no earlier row can repeat a key any more."""
        return not self._repeatable

    def without(self, rows: Iterable[Row | None], keys: set[str]) -> list[Row]:
        """``rows`` with ``keys`` removed from those of the resumed step; rows left with no
        key go, and so do rows that are not one (None)."""
        kept = []
        for row in rows:
            if row is None:
                continue
            if _step(row) == self.step and keys.intersection(_keys(row)):
                row = {key: value for key, value in row.items() if key not in keys}
                if not _keys(row):
                    continue
            kept.append(row)
        return kept


def _step(row: Row | None) -> int | None:
    if row is None:
        return None
    value = row.get("step")
    if isinstance(value, str) and value.isdigit():
        return int(value)
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _keys(row: Row) -> list[str]:
    return [key for key, value in row.items() if key != "step" and value not in ("", None)]
