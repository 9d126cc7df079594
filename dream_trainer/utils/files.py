"""Replacing a file as a whole: a reader sees the old contents or the new, never a part, and a
symlink planted under the name is replaced, never written through."""

from __future__ import annotations

import os
import secrets
from pathlib import Path


def write_atomically(path: Path, data: bytes, mode: int = 0o644) -> Path:
    """Write ``data`` to a fresh name beside ``path`` (created with ``O_EXCL|O_NOFOLLOW``, so
    no existing file or link is opened), flush it to disk, and rename it over ``path``.

    Args:
        path: The file to replace; its directory must exist.
        data: Its new contents.
        mode: The permissions of a new file (0o600 for one only its owner may read).

    Returns:
        ``path``.
    """
    temporary = path.with_name(f".{path.name}.{secrets.token_hex(8)}.tmp")
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    descriptor = os.open(temporary, flags, mode)
    try:
        with os.fdopen(descriptor, "wb") as file:
            file.write(data)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise
    return path
