"""A JSONL file read one line at a time, by offset: a dataset over it holds 16 bytes per line
(not the parsed objects) and pickles cheaply into loader workers."""

from __future__ import annotations

import array
import json
import os
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
