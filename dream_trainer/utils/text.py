"""Strings from outside the code (a checkpoint's metadata, a hang record) shown on a terminal.

Such a string may hold control characters: printed as they are, ESC and BEL sequences
retitle the window, rewrite earlier lines or hide the rest of the output. ``printable``
shows them escaped, as ``repr`` would, so what reaches the terminal is what the file holds.
"""

from __future__ import annotations

import unicodedata


def printable(text: object, keep: str = "") -> str:
    """``text`` (or ``str(text)``) with every control or unprintable character escaped as
    ``repr`` writes it (``\\x1b``, ``\\n``, ``\\u202e``), without repr's quotes. Printable
    text, backslashes included, is left as it is, so names read as they always did.

    Args:
        keep: Characters left as they are (``"\\n"`` for a message of several lines).
    """
    text = str(text)
    if text.isprintable():
        return text
    return "".join(character if character.isprintable() or character in keep
                   else _escaped(character) for character in text)


def has_control(text: str) -> bool:
    """Whether ``text`` holds a control character (category ``Cc``: ESC, BEL, newline, NUL,
    DEL and the C1 range), which a terminal acts on instead of showing."""
    return any(unicodedata.category(character) == "Cc" for character in text)


def _escaped(character: str) -> str:
    return repr(character)[1:-1]
