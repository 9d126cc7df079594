"""The private directory an export writes a model's files in before they replace the old ones.

Whoever can write OUT_DIR could rename the staging directory away and plant a link under its
name, to have the export write into, or move the files of, another directory. So the staging
directory is created new (exclusively, mode 0700, under a random name) and from then on used
only through its descriptor: files are created, listed and moved relative to it, never by a
path that resolves its name again. Its name is checked to still be that directory before its
files replace the old weights, and before it is removed.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import stat
from pathlib import Path
from types import TracebackType

import torch

from dream_trainer.errors import CheckpointError
from dream_trainer.utils.files import LinkRefused, open_dir, open_inside

_CREATE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


def staging_prefix(model: str) -> str:
    """The start of the name of ``model``'s staging directories in OUT_DIR (an export that
    failed leaves one: the next export of the model removes it)."""
    return f".{model}.partial"


class Staging:
    """A private directory in ``out_dir`` for ``model``'s files, used by descriptor.

    Args:
        out_dir: The export's directory (created if missing: a created component must not
            become a link; an existing one is taken as named).
        model: The model whose files it holds.
        name: Open the directory of this name that another rank created (with its
            ``name``), instead of creating one.

    Raises:
        CheckpointError: if ``name`` is not a private directory of this user.
        LinkRefused: if a component of ``out_dir`` created here is a link.
    """

    def __init__(self, out_dir: Path, model: str, name: str | None = None) -> None:
        self.out_dir = out_dir
        self._out = open_dir(out_dir, create=True, follow=True)
        try:
            if name is None:
                name = f"{staging_prefix(model)}.{secrets.token_hex(8)}"
                os.mkdir(name, 0o700, dir_fd=self._out)
            self.name = name
            self.fd = open_inside(self._out, name, out_dir / name)
        except LinkRefused:
            os.close(self._out)
            raise self._replaced() from None
        except BaseException:
            os.close(self._out)
            raise
        info = os.fstat(self.fd)
        self._identity = (info.st_dev, info.st_ino)
        if info.st_uid != os.getuid() or stat.S_IMODE(info.st_mode) & 0o077:
            self.close()
            raise self._replaced()

    @property
    def path(self) -> Path:
        """A path that reaches the directory through its descriptor (``/proc/self/fd``,
        where there is one), for writers that take a path; else its name in ``out_dir``."""
        by_descriptor = Path(f"/proc/self/fd/{self.fd}")
        return by_descriptor if by_descriptor.is_dir() else self.out_dir / self.name

    def write(self, name: str, data: bytes) -> None:
        """Create the file ``name`` in the directory, holding ``data``."""
        with os.fdopen(os.open(name, _CREATE, 0o644, dir_fd=self.fd), "wb") as file:
            file.write(data)

    def save_tensors(self, name: str, tensors: dict[str, torch.Tensor],
                     metadata: dict[str, str]) -> None:
        """Write the safetensors file ``name`` in the directory."""
        from safetensors.torch import save, save_file

        by_descriptor = Path(f"/proc/self/fd/{self.fd}")
        if by_descriptor.is_dir():
            # safetensors writes by path (a temporary file, renamed): this path reaches the
            # directory by its descriptor, and spares holding the file's bytes in memory.
            save_file(tensors, str(by_descriptor / name), metadata=metadata)
        else:
            self.write(name, save(tensors, metadata=metadata))

    def names(self) -> list[str]:
        """The entries of the directory."""
        return os.listdir(self.fd)

    def remove(self, name: str) -> None:
        """Delete the entry ``name`` of the directory (a directory tree, or a file)."""
        if stat.S_ISDIR(os.stat(name, dir_fd=self.fd, follow_symlinks=False).st_mode):
            shutil.rmtree(name, dir_fd=self.fd)
        else:
            os.unlink(name, dir_fd=self.fd)

    def move(self, name: str, target: int, new_name: str | None = None) -> None:
        """Rename the entry ``name`` into the directory open as ``target`` (replacing what
        is there under ``new_name``, a link included, without following it)."""
        os.replace(name, new_name or name, src_dir_fd=self.fd, dst_dir_fd=target)

    def open_out(self) -> int:
        """A new descriptor of ``out_dir``, as the staging directory sees it."""
        return os.dup(self._out)

    def check(self) -> None:
        """Raise unless the staging name still names this directory.

        Raises:
            CheckpointError: naming the directory, if it was renamed or replaced.
        """
        try:
            info = os.stat(self.name, dir_fd=self._out, follow_symlinks=False)
        except FileNotFoundError:
            raise self._replaced() from None
        if (info.st_dev, info.st_ino) != self._identity:
            raise self._replaced()

    def finish(self) -> None:
        """Remove the directory, emptied by moving its files into place, and close it.

        Raises:
            CheckpointError: if its name no longer names it (the files are in place).
        """
        try:
            try:
                self.check()
            except CheckpointError:
                raise self._replaced(published=True) from None
            os.rmdir(self.name, dir_fd=self._out)
        finally:
            self.close()

    def discard(self) -> None:
        """Delete what the directory holds and, if its name is still its own, the directory
        itself; errors are ignored (the next export removes what is left)."""
        with contextlib.suppress(OSError):
            for name in self.names():
                with contextlib.suppress(OSError):
                    self.remove(name)
            with contextlib.suppress(CheckpointError):
                self.check()
                os.rmdir(self.name, dir_fd=self._out)
        self.close()

    def close(self) -> None:
        for descriptor in (self.fd, self._out):
            with contextlib.suppress(OSError):
                os.close(descriptor)
        self.fd = self._out = -1

    def __enter__(self) -> Staging:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 traceback: TracebackType | None) -> None:
        if self.fd >= 0:
            self.discard()

    def _replaced(self, published: bool = False) -> CheckpointError:
        outcome = ("the new weights are in place, but check them" if published else
                   "the weights there were left as they were")
        return CheckpointError(
            f"the export's staging directory {self.out_dir / self.name} was renamed or "
            "replaced while the export wrote it: something else writes OUT_DIR at the same "
            "time. Nothing was read or written through what replaced it and "
            f"{outcome}; stop that writer, or export to a directory only you can write, "
            "and export again")
