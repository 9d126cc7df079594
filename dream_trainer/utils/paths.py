"""Names from outside the code (a config, a checkpoint) that become one component of a path.

A run's name, a model's name read from a checkpoint and a file name in a checkpoint's
metadata are each joined to a directory the library writes or reads. Joined unchecked, an
absolute name replaces the directory (``Path("out") / "/etc/x"`` is ``/etc/x``) and ``..``
climbs out of it, so such a name must be one plain component.
"""

from __future__ import annotations

from dream_trainer.utils.text import has_control


def component_problem(name: object) -> str | None:
    """Why ``name`` is not one plain path component, or None if it is.

    A plain component is a non-empty string without ``/``, ``\\``, NUL or another control
    character that is not ``.`` or ``..``: joined to a directory, it names an entry of that
    directory and nothing else, and printed, it drives no terminal.
    """
    if not isinstance(name, str):
        return f"is a {type(name).__name__}, not a string"
    if not name:
        return "is empty"
    if "\0" in name:
        return "contains a NUL character"
    if has_control(name):
        # A name is printed (an export lists each model's file), and ESC or BEL sequences
        # in it would drive the terminal that shows it.
        return "contains a control character"
    if name.startswith("/"):
        return "is an absolute path"
    if "/" in name or "\\" in name:
        return "contains a path separator"
    if name in (".", ".."):
        return f"is {name!r}, a directory itself or its parent rather than an entry in it"
    return None
