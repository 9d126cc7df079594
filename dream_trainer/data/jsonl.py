"""A JSONL file read one line at a time, by offset: a dataset over it holds 16 bytes per line
(not the parsed objects) and pickles cheaply into loader workers; ``Records``, the items of a
dataset given as such a file or as a sequence, as ``ChatDataset`` and ``PreferenceDataset``
read and name them."""

from __future__ import annotations

import array
import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any


class JsonLines:
    """The non-blank lines of a JSONL file, indexed once.

    Args:
        path: The file.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self._offsets = array.array("q")
        self._numbers = array.array("q")
        with self.path.open("rb") as file:
            offset = 0
            for number, line in enumerate(file, start=1):
                if line.strip():
                    self._offsets.append(offset)
                    self._numbers.append(number)
                offset += len(line)

    def __len__(self) -> int:
        return len(self._offsets)

    def line_number(self, index: int) -> int:
        """The file's line number (from 1) of item ``index``."""
        return self._numbers[index]

    def read(self, index: int, sample: str) -> Any:
        """Item ``index``, parsed.

        Raises:
            ValueError: naming ``sample``, for a line that is not valid JSON.
        """
        with self.path.open("rb") as file:
            file.seek(self._offsets[index])
            line = file.readline()
        try:
            return json.loads(line)
        except json.JSONDecodeError as error:
            raise ValueError(f"{sample} is not valid JSON: {error}") from None


class Records:
    """A dataset's items: the lines of a JSONL file (``JsonLines``) or a sequence of
    mappings, each fetched by index and named in errors by its file line.

    Args:
        source: A JSONL path, or a sequence (a list, a ``datasets.Dataset``).
        noun: What the items are, in the plural, for the out-of-range error
            (``"conversations"``).

    Attributes:
        path: The JSONL file, or None for a sequence.
        source: The sequence, or None for a file.
    """

    def __init__(self, source: str | os.PathLike[str] | Sequence[Mapping[str, Any]],
                 noun: str) -> None:
        self.noun = noun
        self.path: Path | None = None
        self.source: Sequence[Mapping[str, Any]] | None = None
        self._file: JsonLines | None = None
        if isinstance(source, (str, os.PathLike)):
            self._file = JsonLines(source)
            self.path = self._file.path
        else:
            self.source = source

    def __len__(self) -> int:
        return len(self.source) if self.source is not None else len(self._file or ())

    def origin(self) -> str:
        """The file, or ``"the <type of the sequence>"``."""
        return str(self.path) if self.path is not None else f"the {type(self.source).__name__}"

    def describe(self, index: int) -> str:
        """How errors name item ``index``: ``"sample 3 (chats.jsonl line 4)"``."""
        if self._file is None:
            return f"sample {index}"
        return f"sample {index} ({self.path} line {self._file.line_number(index)})"

    def checked(self, index: int) -> int:
        """``index`` as a position from 0 (a negative one counts from the end).

        Raises:
            IndexError: outside the items.
        """
        size = len(self)
        if not -size <= index < size:
            raise IndexError(f"sample {index} is out of range for {size} {self.noun}")
        return int(index) % size

    def get(self, index: int) -> Any:
        """Item ``index`` (a position from ``checked``), parsed from its line for a file.

        Raises:
            ValueError: for a line that is not valid JSON, naming it.
        """
        if self.source is not None:
            return self.source[index]
        assert self._file is not None
        return self._file.read(index, self.describe(index))
