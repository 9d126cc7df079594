"""``models.json``: what a checkpoint records of its models beside their state, namely the
sources of the frozen weights it leaves out (``checkpoint.frozen``) and each peft model's
adapter config (``checkpoint.adapter_export``)."""


from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from dream_trainer.checkpoint.directory import RECORD, CheckpointInfo, checksum, is_complete
from dream_trainer.checkpoint.storage import location, storage_for
from dream_trainer.checkpoint.storage_base import Location
from dream_trainer.errors import CheckpointError
from dream_trainer.utils.bounded import read_bounded
from dream_trainer.weights.hf import INDEX, safetensors_names
from dream_trainer.weights.peft_sources import ADAPTER_CONFIG, json_value
from dream_trainer.world.agree import gather_objects, is_distributed



@dataclass(frozen=True)
class FrozenSource:
    """Where a model's left-out weights come from.

    Attributes:
        paths: The ``init_weights_from`` directories or URLs, in the order they were read.
        checksum: SHA-256 over the SHA-256 of every weight file under them.
        keys: The model's state keys the checkpoint leaves out (frozen, set by the files).
    """

    paths: tuple[str, ...]
    checksum: str
    keys: tuple[str, ...]

    def describe(self) -> str:
        return f"{' + '.join(self.paths)} (checksum {self.checksum[:12]})"


def source_checksum(paths: Iterable[Location]) -> str:
    """The checksum of the weight files under ``paths`` (collective: each rank hashes a
    share of the files; every rank returns the same).

    A Hugging Face directory's or adapter folder's files are hashed (its safetensors, its
    index, an adapter's config); a dream_trainer checkpoint's recorded file checksums are
    used as they are (a load verifies its files against them).
    """
    entries = []
    for index, path in enumerate(paths):
        storage = storage_for(path)
        if is_complete(path):
            files = CheckpointInfo.read(path).files or {}
            entries += [(index, f"{name}={digest}", None) for name, digest in files.items()]
            continue
        names = safetensors_names(path, storage)
        names += [name for name in (INDEX, ADAPTER_CONFIG) if storage.is_file(path / name)]
        entries += [(index, name, path / name) for name in sorted(names)]
    mine = {(index, name): (checksum(file) if file is not None else "")
            for index, name, file in _share(entries)}
    digests = {key: value for share in gather_objects(mine) for key, value in share.items()}
    hasher = hashlib.sha256()
    for index, name, _ in entries:
        hasher.update(f"{index}:{name}:{digests[(index, name)]}\n".encode())
    return hasher.hexdigest()


def _share(entries: list[Any]) -> list[Any]:
    """This rank's files of ``entries``, dealt round-robin."""
    if not is_distributed():
        return entries
    return entries[dist.get_rank()::dist.get_world_size()]


def write_record(directory: Location, sources: Mapping[str, FrozenSource],
                 adapters: Mapping[str, dict[str, Any]]) -> None:
    """Write ``models.json`` into the checkpoint ``directory`` (rank 0)."""
    payload = {"frozen": {name: {"paths": list(source.paths), "checksum": source.checksum,
                                 "keys": list(source.keys)}
                          for name, source in sources.items()},
               "adapters": dict(adapters)}
    storage_for(directory).write_bytes(directory / RECORD,
                                       json.dumps(payload, indent=2, default=json_value).encode())


def read_record(directory: Location) -> tuple[dict[str, FrozenSource], dict[str, Any]]:
    """The frozen sources and adapter configs that the checkpoint at ``directory`` records
    (none for a checkpoint without ``models.json``).

    Raises:
        CheckpointError: naming the file, when it is not a record.
    """
    file = directory / RECORD
    storage = storage_for(file)
    if not storage.is_file(file):
        return {}, {}
    try:
        with storage.open_file(file) as handle:
            data = json.loads(read_bounded(handle, file))
        frozen = {name: FrozenSource(tuple(_strings(entry["paths"])), str(entry["checksum"]),
                                     tuple(_strings(entry["keys"])))
                  for name, entry in data["frozen"].items()}
        adapters = data["adapters"]
        if not isinstance(adapters, dict):
            raise TypeError("'adapters' is not an object")
    except (OSError, ValueError, KeyError, TypeError, AttributeError, RecursionError) as exc:
        raise CheckpointError(f"{file} cannot be read ({type(exc).__name__}: {exc}): the "
                              f"checkpoint is damaged; resume from another one") from exc
    return frozen, adapters


def _strings(value: Any) -> list[str]:
    if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
        raise TypeError(f"{value!r} is not a list of strings")
    return value


def check_same_source(checkpoint: Location, model: str, recorded: FrozenSource,
                      current: FrozenSource) -> None:
    """Refuse to resume on another base than the checkpoint's.

    Raises:
        CheckpointError: naming both sources and their checksums, or the keys the
            checkpoint left out that the current source does not set.
    """
    if recorded.checksum != current.checksum:
        raise CheckpointError(
            f"checkpoint {checkpoint} leaves out the frozen weights of model {model!r}, which "
            f"came from {recorded.describe()}, but this run's are {current.describe()}: the "
            "files differ, and the trained weights only fit the base they were trained on. "
            "Resume with init_weights_from naming the original files (the checksum "
            "covers every weight file), or start a new run")
    unset = sorted(set(recorded.keys) - set(current.keys))
    if unset:
        raise CheckpointError(
            f"checkpoint {checkpoint} leaves out {len(unset)} frozen weights of model "
            f"{model!r} ({', '.join(unset[:5])}{' ...' if len(unset) > 5 else ''}) that this "
            f"run's init_weights_from does not set: keep map_pretrained_key as it was")


def recorded_paths(source: FrozenSource) -> list[Location]:
    return [location(path) for path in source.paths]
