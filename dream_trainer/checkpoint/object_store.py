"""Checkpoints in an object store (``s3://bucket/prefix``, or any fsspec URL) through fsspec:
DCP writes through its fsspec storage, and files are listed, read and deleted by the same
client. Credentials and the endpoint come from the environment as boto3 reads them
(``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``, ``AWS_PROFILE``, ``AWS_ENDPOINT_URL``...):
nothing here reads, stores or logs them.

An object is written whole by one PUT, so a reader sees a file complete or not at all; a
checkpoint is complete once its ``dream_trainer.json`` is written, last, as on a disk. The
run lock is an object created with a conditional write (``If-None-Match: *``): of two runs,
one creates it and the other is refused. Only S3 (s3fs 2024.12 or newer) is known to make
that write atomic: an older s3fs is refused at first use, and another scheme's lock at setup.
"""

from __future__ import annotations

import functools
import logging
import os
import re
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

from dream_trainer.checkpoint.lock import LOCK, RecordLock
from dream_trainer.checkpoint.lock_holder import LockHolder
from dream_trainer.checkpoint.storage_base import ObjectPath, RunLockLike, Storage, below
from dream_trainer.errors import CheckpointError

logger = logging.getLogger(__name__)


# The environment that configures a client: a client made before it changed (a test's new
# endpoint) is not reused.
_CLIENT_ENVIRONMENT = ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_PROFILE",
                       "AWS_ACCESS_KEY_ID", "AWS_DEFAULT_REGION", "AWS_REGION")


S3FS_CONDITIONAL_CREATE = "2024.12"
"""The first s3fs whose ``pipe_file(mode="create")`` is a conditional PUT (``If-None-Match:
*``, s3fs 2024.12.0, "exclusive write"): older ones have no ``mode`` or ignore it, so two
runs could both create the lock."""

_S3_SCHEMES = ("s3", "s3a")
"""The schemes whose lock is a conditional create this module has checked (s3fs's)."""


def object_storage(path: ObjectPath) -> ObjectStorage:
    """The storage of ``path``'s scheme (one client per scheme and environment).

    Raises:
        CheckpointError: if the scheme's fsspec implementation is not installed, or is an
            s3fs older than ``S3FS_CONDITIONAL_CREATE``.
    """
    return _storage(path.url.split("://", 1)[0],
                    tuple(os.environ.get(name) for name in _CLIENT_ENVIRONMENT))


@functools.cache
def _storage(scheme: str, environment: tuple[str | None, ...]) -> ObjectStorage:
    import fsspec

    try:
        filesystem = fsspec.get_filesystem_class(scheme)
    except ImportError as exc:
        extra = " (pip install 'dream-trainer[s3]')" if scheme in _S3_SCHEMES else ""
        raise CheckpointError(f"checkpoints at {scheme}:// URLs need fsspec's {scheme} "
                              f"filesystem, which is not installed{extra}: {exc}") from exc
    if scheme in _S3_SCHEMES:
        _check_s3fs()
    # fsspec caches clients by their arguments, not the environment they were made in: the
    # ones DCP's writer gets must not predate this one.
    filesystem.clear_instance_cache()
    # Listings are never cached: other ranks and runs write the same prefixes.
    return ObjectStorage(filesystem(use_listings_cache=False))


def _check_s3fs() -> None:
    import s3fs

    installed = str(getattr(s3fs, "__version__", "of unknown version"))
    if _release(installed) < _release(S3FS_CONDITIONAL_CREATE):
        raise CheckpointError(
            f"s3fs {installed} is installed, but s3:// URLs need s3fs>={S3FS_CONDITIONAL_CREATE}"
            ": an older s3fs writes the run lock object unconditionally (no If-None-Match: *),"
            " so two runs of one experiment could both hold it and delete each other's "
            f"checkpoints. Fix: pip install 's3fs>={S3FS_CONDITIONAL_CREATE}' (or pip install "
            "'dream-trainer[s3]')")


def _release(version: str) -> tuple[int, ...]:
    """The leading release numbers of ``version`` (``2024.12.0.dev3`` gives (2024, 12, 0);
    none gives (), older than any). packaging is not a dependency, and s3fs versions are
    plain dates."""
    numbers = re.match(r"\d+(\.\d+)*", version)
    return tuple(int(n) for n in numbers.group().split(".")) if numbers else ()


def _lock_problem(path: ObjectPath) -> str | None:
    """Why no run lock that keeps two runs apart can be made at ``path``, or None."""
    scheme = path.url.split("://", 1)[0]
    if scheme in _S3_SCHEMES:
        return None
    return (f"the run lock at {path} needs a create-if-absent that the store makes atomic, "
            f"which dream_trainer has checked only for S3 (s3fs's conditional PUT), not for "
            f"fsspec's {scheme} filesystem: two runs there could both hold it and delete each "
            "other's checkpoints. Write checkpoints under an s3:// URL (AWS S3, or an "
            "S3-compatible service that honours If-None-Match) or a local or shared path; "
            f"resume and init_weights_from may still read from {scheme}:// URLs")


def _failures() -> tuple[type[BaseException], ...]:
    try:
        from botocore.exceptions import BotoCoreError
    except ImportError:
        return (OSError,)
    return (OSError, BotoCoreError)


class ObjectStorage(Storage):
    """An fsspec filesystem: an object store whose keys ``/`` divides into directories."""

    read_block_bytes = 2**20
    """How far past each read of pretrained weights (``open_file``) a request reaches. A
    rank reads its slice of each tensor, then seeks to the next tensor: s3fs's default
    read-ahead of 50 MiB would fetch much of the slices other ranks own."""

    def __init__(self, fs: Any) -> None:
        self.fs = fs
        self.failures = _failures()

    def is_file(self, path: ObjectPath) -> bool:
        return bool(self.fs.isfile(path.url))

    def is_dir(self, path: ObjectPath) -> bool:
        return bool(self.fs.isdir(path.url))

    def list_dir(self, path: ObjectPath) -> list[tuple[str, bool]]:
        try:
            entries = self.fs.ls(path.url, detail=True)
        except FileNotFoundError as exc:
            if _no_bucket(exc):
                raise
            return []
        return [(entry["name"].rstrip("/").rsplit("/", 1)[-1], entry["type"] == "directory")
                for entry in entries]

    def read_bytes(self, path: ObjectPath) -> bytes:
        return bytes(self.fs.cat_file(path.url))

    def write_bytes(self, path: ObjectPath, data: bytes, mode: int = 0o644) -> None:
        self.fs.pipe_file(path.url, data)

    def make_dir(self, path: ObjectPath) -> None:
        """Nothing to do: a key's prefixes exist as soon as it does."""

    def remove_tree(self, path: ObjectPath) -> None:
        try:
            self.fs.rm(path.url, recursive=True)
        except (FileNotFoundError, *self.failures) as exc:
            logger.warning("could not delete %s (retention tries again at the next save): %s",
                           path, self.advice(path, exc) or exc)

    def file_size(self, path: ObjectPath) -> int:
        try:
            info = self.fs.info(path.url)
        except FileNotFoundError:
            raise CheckpointError(f"checkpoint file {path} is missing") from None
        if info.get("type") != "file":
            raise CheckpointError(f"checkpoint file {path} is not a regular file")
        return int(info["size"])

    def open(self, path: ObjectPath) -> IO[bytes]:
        try:
            return self.fs.open(path.url, "rb")  # type: ignore[no-any-return]
        except FileNotFoundError:
            raise CheckpointError(f"checkpoint file {path} is missing") from None

    def open_size(self, file: IO[bytes]) -> int:
        return int(file.size)  # type: ignore[attr-defined]

    def open_file(self, path: ObjectPath) -> IO[bytes]:
        try:
            file = self.fs.open(path.url, "rb", block_size=self.read_block_bytes,
                                cache_type="readahead")
        except FileNotFoundError:
            raise CheckpointError(f"{path} is missing") from None
        return file  # type: ignore[no-any-return]

    @contextmanager
    def local_dir(self, target: ObjectPath, replaced: Callable[[str], bool]) -> Iterator[Path]:
        with tempfile.TemporaryDirectory(prefix="dream-trainer-") as directory:
            yield Path(directory)
            try:
                self._upload(Path(directory), target, replaced)
            except self.failures as exc:
                raise CheckpointError(f"cannot write {target}: "
                                      f"{self.explain(target, exc)}") from exc

    def _upload(self, local: Path, target: ObjectPath, replaced: Callable[[str], bool]) -> None:
        """Put every file under ``local`` at the same place under ``target``, then delete the
        ``replaced`` objects of each written directory that were not written anew."""
        written: dict[tuple[str, ...], set[str]] = {}
        for file in sorted(local.rglob("*")):
            if file.is_file():
                *folders, name = file.relative_to(local).parts
                self.fs.put_file(str(file), below(target, *folders, name).url)
                written.setdefault(tuple(folders), set()).add(name)
        for folders, names in written.items():
            directory = below(target, *folders)
            for name, is_dir in self.list_dir(directory):
                if not is_dir and replaced(name) and name not in names:
                    self.fs.rm_file((directory / name).url)

    def writer(self, path: ObjectPath) -> Any:
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

        # An object is durable once its upload completes; syncing would os.sync() the host.
        return FsspecWriter(path.url, sync_files=False)

    def lock(self, directory: ObjectPath) -> RunLockLike:
        return ObjectLock(self, directory)

    def access_problem(self, path: ObjectPath, probe: str | None = None) -> str | None:
        """See ``Storage.access_problem``: a listing of ``path`` (one request), and with a
        ``probe`` a PUT and a DELETE of an empty object, so that a missing bucket, missing
        credentials, a read-only key or a store the run lock cannot be made atomic in (see
        ``ObjectLock``) fail before a run builds its models."""
        if probe is not None and (problem := _lock_problem(path)) is not None:
            return problem
        try:
            self.list_dir(path)  # raises for a missing bucket, unlike isdir
            if probe is not None:
                self.fs.pipe_file((path / probe).url, b"")
                self.fs.rm_file((path / probe).url)
        except (FileNotFoundError, *self.failures) as exc:
            return self.explain(path, exc)
        return None

    def advice(self, path: ObjectPath, exc: BaseException) -> str | None:
        """What ``exc`` from an operation on ``path`` means and the fix, or None."""
        bucket = path.url.split("://", 1)[1].split("/", 1)[0]
        endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
        where = f"the endpoint {endpoint} (AWS_ENDPOINT_URL)" if endpoint \
            else "the default AWS endpoint (set AWS_ENDPOINT_URL for another S3 service)"
        name = type(exc).__name__
        if isinstance(exc, FileNotFoundError) and _no_bucket(exc):
            return (f"the bucket {bucket!r} of {path} does not exist at {where}: create it, "
                    "or correct the URL")
        if isinstance(exc, PermissionError):
            return (f"access to {path} was denied: give the credentials in the environment "
                    "(AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY or AWS_PROFILE) permission to "
                    f"list, read, write and delete under it ({exc})")
        if "Credentials" in name:
            return (f"no credentials to reach {path}: set AWS_ACCESS_KEY_ID and "
                    "AWS_SECRET_ACCESS_KEY (or AWS_PROFILE) in the environment")
        if "Connect" in name or "Connection" in str(exc) or isinstance(exc, ConnectionError):
            return (f"cannot reach {where} to write or read {path}: check the network and "
                    "the endpoint")
        return None


def _no_bucket(exc: BaseException) -> bool:
    return "bucket" in str(exc).lower()


class ObjectLock(RecordLock):
    """One run at a time per experiment in an object store: ``<directory>/.lock`` created by a
    conditional write, holding the same record as ``checkpoint.lock.RunLock``'s file.

    A store that ignored the condition would let two runs both create the lock, so each
    creation is repeated, and must now be refused, then read back; only S3 URLs are locked
    (see ``_lock_problem``). The store cannot tell whether a holder still runs. A record
    naming a dead process on this kernel (a killed run restarted on the same machine) is
    taken over through the conditional creation of ``.lock.takeover``, so that of several
    runs exactly one wins; a holder on another machine is refused: delete the lock object
    once that run is gone.

    Args:
        storage: The object store.
        directory: The experiment's checkpoint directory.
    """

    _delete_word = "delete"

    def __init__(self, storage: ObjectStorage, directory: ObjectPath) -> None:
        self.storage = storage
        self.path = directory / LOCK
        self.holder = LockHolder.this_process()
        self.held = False

    def acquire(self) -> None:
        """Take the lock.

        Raises:
            CheckpointError: naming the holder if another run holds it, the reason if the
                store cannot make the lock atomic, or the URL and the fix if the store
                cannot be written.
        """
        problem = _lock_problem(self.path.parent)
        if problem is not None:
            raise CheckpointError(problem)
        try:
            if not self._create(self.path):
                self._take_over()
        except CheckpointError:
            raise
        except Exception as exc:  # noqa: BLE001 - any other answer is no lock, never success
            raise CheckpointError(f"cannot take the run lock {self.path}: "
                                  f"{self.storage.explain(self.path, exc)}") from exc
        self.held = True

    def release(self) -> None:
        """Delete the lock object if this run still holds it; never raises (a client that
        fails is logged, naming the object left behind)."""
        if not self.held:
            return
        self.held = False
        try:
            if self._read_record() == self.holder:
                self.storage.fs.rm_file(self.path.url)
        except Exception as exc:  # noqa: BLE001 - teardown must not fail on the client
            self._left(self.path, exc)

    def _left(self, path: ObjectPath, exc: BaseException) -> None:
        logger.warning("could not delete %s, so it is left in the store: delete it before "
                       "this experiment runs again from another machine (%s)", path,
                       self.storage.advice(path, exc) or
                       (f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__))

    def _create(self, path: ObjectPath) -> bool:
        """Write this run's record to ``path`` if no object is there; whether it was.

        Raises:
            CheckpointError: if the store created the object twice (it ignores
                ``If-None-Match``), or what was created is not this run's record.
        """
        record = self._record()
        try:
            self.storage.fs.pipe_file(path.url, record, mode="create")
        except FileExistsError:  # s3fs's answer to 412 Precondition Failed
            return False
        # The same create again must be refused now: a store that ignores the condition
        # would let every run "create" the lock, and a read-back alone misses a run that
        # writes after it.
        try:
            self.storage.fs.pipe_file(path.url, record, mode="create")
        except FileExistsError:
            pass
        else:
            raise CheckpointError(
                f"the object store created {path} twice: it ignores the condition "
                "If-None-Match: *, so the run lock cannot keep two runs apart there. Use a "
                "store that honours conditional writes (AWS S3 does) or a local path for "
                f"checkpoints, and delete {path}")
        stored = self.storage.read_bytes(path)
        if stored != record:
            # Both creates were accepted: the store checked the condition and wrote apart
            # (moto does under load). Whoever wrote last holds the object; refuse, naming it.
            replaced = ("it replaced this run's record right after the store accepted both "
                        "as new, so the store's conditional writes are not atomic")
            try:
                holder = LockHolder.parse(stored.decode())
            except ValueError:
                holder = None
            if path == self.path and holder is not None:
                raise self._refusal(holder, replaced)
            raise CheckpointError(f"{path} does not hold this run's record right after it "
                                  f"was created: {replaced}; stop the other run and delete "
                                  f"{path}")
        return True

    def _read_record(self) -> LockHolder | str | None:
        try:
            return LockHolder.parse(self.storage.read_bytes(self.path).decode())
        except FileNotFoundError:
            return None
        except ValueError as exc:  # includes UnicodeDecodeError
            return f"the lock object {self.path} is unreadable ({exc})"

    def _take_over(self) -> None:
        current = self._read_record()
        if current is None:  # released meanwhile
            if self._create(self.path):
                return
            current = self._read_record()
        if not isinstance(current, LockHolder) or not (
                current.is_alive(self.holder) is False or self._mine(current)):
            raise self._refusal(current)
        self._replace_dead(current)

    def _replace_record(self) -> None:
        self.storage.write_bytes(self.path, self._record())

    def _delete(self, path: ObjectPath) -> None:
        try:
            self.storage.fs.rm_file(path.url)
        except Exception as exc:  # noqa: BLE001 - would hide the outcome of the take-over
            self._left(path, exc)

    def _changed(self, now: LockHolder | str | None) -> CheckpointError:
        return self._refusal(now)  # which says itself that a record is gone

    def _log_takeover(self, current: LockHolder) -> None:
        if self._mine(current):
            logger.info("taking over the lock an earlier trainer of this process left")
        else:
            super()._log_takeover(current)

    def _mine(self, current: LockHolder) -> bool:
        """Whether ``current`` is this very process: an earlier trainer of it that could not
        delete its lock (the store was unreachable when it ended)."""
        return current.unverifiable(self.holder) is None and current.pid == self.holder.pid \
            and current.process_start == self.holder.process_start

    def _refusal(self, current: LockHolder | str | None,
                 note: str | None = None) -> CheckpointError:
        if isinstance(current, LockHolder):
            why = current.unverifiable(self.holder)
            holder = current.describe() + ("" if why is None else
                                           f" ({why}, so whether it still runs cannot be "
                                           "checked from here)")
        else:
            holder = current or "its record is gone (its holder was releasing it)"
        if note is not None:
            holder = f"{holder}; {note}"
        return CheckpointError(
            f"another run holds the lock on {self.path.parent}: {holder}. Two runs writing "
            "one experiment's checkpoints would delete and resume each other's: stop that "
            f"run, use another experiment name or root_dir, or delete {self.path} if that run "
            "is gone")
