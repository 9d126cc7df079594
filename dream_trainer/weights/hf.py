"""The Hugging Face safetensors layout: recognizing it, and writing it from a live run.

A Hugging Face weights directory holds ``model.safetensors``, or shards
``model-00001-of-0000N.safetensors`` with ``model.safetensors.index.json`` mapping each key
to its shard. ``export_live`` writes that layout from models of any parallel layout with
torch DCP's ``HuggingFaceStorageWriter``: every rank writes its own slices, then rank 0
consolidates them into full tensors (the ranks need a shared filesystem, as checkpoints do).
A stacked parameter that transformers' files hold as one tensor per expert
(``weights.stacked``) is written so, each rank writing the experts it holds.

Reading goes through ``Files``, the storage that holds the directory (a local one or an
object store: ``dream_trainer.checkpoint.storage`` provides both), so the same checks and
reads serve ``/path/to/weights`` and ``s3://bucket/weights``.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import os
import shutil
import stat
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import IO, Any, Literal, Protocol

import torch
from torch import nn

from dream_trainer.errors import CheckpointError
from dream_trainer.nn.hf_moe import StackedKey
from dream_trainer.parallel.dtensor import is_dtensor
from dream_trainer.parallel.hf_init import is_hf_model
from dream_trainer.parallel.names import clean_name, unwrap_ddp
from dream_trainer.parallel.pipeline import PipelineStages, unwrap_stage
from dream_trainer.parallel.state_dict import model_state_dict
from dream_trainer.utils.files import open_dir, open_inside
from dream_trainer.utils.bounded import MAX_INDEX_BYTES, read_bounded
from dream_trainer.weights.keys import KeyMap, TransformedKey, exported_names
from dream_trainer.weights.stacked import model_rules, split_local
from dream_trainer.weights.staging import Staging, staging_prefix
from dream_trainer.world.agree import barrier, from_rank_zero, gather_objects, is_rank_zero

logger = logging.getLogger(__name__)

WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"
CONFIG = "config.json"
DEFAULT_MAX_SHARD_BYTES = 5 * 2**30
"""Shard size of an export unless asked otherwise: 5 GiB, transformers 4's default."""

ExportFormat = Literal["hf", "safetensors", "peft"]

StateOf = Callable[[nn.Module], Mapping[str, Any]]
"""What an export writes of a model: its state dict (``model_state_dict``), or another view
of it keyed as that model's state dict would be (``weights.peft_merge.merged_state``)."""


class Files(Protocol):
    """What the layout needs of the storage that holds a directory (``path`` is a ``Path``,
    or a location of that storage that joins with ``/`` as one does)."""

    def is_file(self, path: Any) -> bool: ...

    def is_dir(self, path: Any) -> bool: ...

    def list_dir(self, path: Any) -> list[tuple[str, bool]]: ...

    def read_bytes(self, path: Any) -> bytes: ...

    def open_file(self, path: Any) -> IO[bytes]: ...


def is_hf_dir(path: Any, files: Files) -> bool:
    """True when ``path`` holds ``model.safetensors`` or ``model.safetensors.index.json``."""
    return files.is_file(path / WEIGHTS) or files.is_file(path / INDEX)


def is_weight_file(name: str) -> bool:
    """Whether the file ``name`` of a Hugging Face directory is part of its weights (what
    an export replaces), not its configuration or tokenizer."""
    return name.endswith(".safetensors") or name == INDEX


def safetensors_names(path: Any, files: Files) -> list[str]:
    """The ``*.safetensors`` files of the directory ``path``, sorted."""
    return sorted(name for name, is_dir in files.list_dir(path)
                  if not is_dir and name.endswith(".safetensors"))


def check_hf_dir(path: Any, files: Files) -> None:
    """Check that every file the index names is there and no stray weights file is.

    DCP's ``HuggingFaceStorageReader`` reads every ``*.safetensors`` file of the directory,
    so a leftover file (an older export's shard) would be read as part of the weights.

    Raises:
        CheckpointError: naming the index that is not one, the missing shard or the stray
            file.
    """
    present = set(safetensors_names(path, files))
    indexed = files.is_file(path / INDEX)
    expected = _indexed_files(path / INDEX, files) if indexed else {WEIGHTS}
    missing = sorted(expected - present)
    if missing:
        raise CheckpointError(f"{path} lacks the weight files {', '.join(missing)} that "
                              f"{INDEX} names: copy the complete directory")
    stray = sorted(present - expected)
    if stray:
        raise CheckpointError(f"{path} holds weight files that are not part of its "
                              f"{'index' if indexed else WEIGHTS}: "
                              f"{', '.join(stray)}; move them elsewhere")


def _indexed_files(index: Any, files: Files) -> set[str]:
    """The weight files a ``model.safetensors.index.json`` maps keys to.

    Raises:
        CheckpointError: naming the file, if it is not such an index.
    """
    try:
        with files.open_file(index) as file:
            data = json.loads(read_bounded(file, index, MAX_INDEX_BYTES))
    except (OSError, ValueError, RecursionError) as exc:  # ValueError: not JSON or UTF-8
        raise CheckpointError(f"{index} cannot be read as a safetensors index: "
                              f"{type(exc).__name__}: {exc}") from exc
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not (isinstance(weight_map, dict)
            and all(isinstance(file, str) for file in weight_map.values())):
        raise CheckpointError(
            f"{index} is not a safetensors index: it must be a JSON object whose "
            '"weight_map" maps each key to its file; fix the file, or delete it if the '
            "directory holds one model.safetensors")
    return set(weight_map.values())


def shard_file_names(count: int, stem: str = "model") -> list[str]:
    """``model.safetensors`` for one file, else ``model-0000i-of-0000N.safetensors``."""
    if count == 1:
        return [f"{stem}.safetensors"]
    return [f"{stem}-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)]


def plan_shards(sizes: Mapping[str, int], max_shard_bytes: int) -> list[list[str]]:
    """Split keys, in order, into shards of at most ``max_shard_bytes`` (a larger tensor gets
    a shard of its own)."""
    if max_shard_bytes <= 0:
        raise ValueError(f"max_shard_bytes must be positive, got {max_shard_bytes}")
    shards: list[list[str]] = [[]]
    used = 0
    for key, size in sizes.items():
        if shards[-1] and used + size > max_shard_bytes:
            shards.append([])
            used = 0
        shards[-1].append(key)
        used += size
    return shards


def write_index(staging: Staging, shards: list[list[str]], sizes: Mapping[str, int]) -> None:
    """Write ``model.safetensors.index.json`` for ``shards`` named by ``shard_file_names``."""
    names = shard_file_names(len(shards))
    index = {"metadata": {"total_size": sum(sizes.values())},
             "weight_map": {key: name for keys, name in zip(shards, names) for key in keys}}
    staging.write(INDEX, json.dumps(index, indent=2).encode())


def tied_groups(model: nn.Module) -> dict[str, int]:
    """State-dict key -> group number, for keys whose parameter another key shares (in the
    whole model: a pipeline's stages may each hold a copy under one of the names)."""
    root = unwrap_ddp(model)
    if isinstance(root, PipelineStages):
        return {name: number for number, names in enumerate(root.ties) for name in names}
    by_param: dict[int, list[str]] = {}
    for name, param in root.named_parameters(remove_duplicate=False):
        by_param.setdefault(id(param), []).append(clean_name(name))
    groups = [names for names in by_param.values() if len(set(names)) > 1]
    return {name: number for number, names in enumerate(groups) for name in names}


def exported_state(name: str, model: nn.Module, map_key: KeyMap | None,
                   dtype: torch.dtype | None,
                   rules: Mapping[str, StackedKey] | None = None,
                   state_of: StateOf = model_state_dict) -> dict[str, torch.Tensor]:
    """The model's tensors (``state_of(model)``) as they are exported: sharded as the model
    is, tied copies dropped (the first key of each tied group is kept), split as ``rules``
    say (each rank contributes the slices of a stacked tensor it holds), keys mapped,
    floats cast.

    Raises:
        ValueError: if two keys map to the same exported key, or a stacked tensor is sharded
            along another dimension than its first.
    """
    groups = tied_groups(model)
    seen_groups: set[int] = set()
    tensors: dict[str, torch.Tensor] = {}
    for key, tensor in state_of(model).items():
        if not isinstance(tensor, torch.Tensor):
            continue
        group = groups.get(key)
        if group is not None:
            if group in seen_groups:
                continue
            seen_groups.add(group)
        tensors[key] = tensor
    if rules:
        tensors = split_local(tensors, rules)
    exported = {}
    for target, (key, transform) in exported_names(name, tensors, map_key).items():
        tensor = tensors[key]
        if transform is not None:
            tensor = _transformed(tensor, transform)
        exported[target] = tensor.to(dtype) if dtype is not None \
            and tensor.is_floating_point() else tensor
    return exported


def _transformed(tensor: torch.Tensor, transform: TransformedKey) -> torch.Tensor:
    """``transform``'s file tensor of the model's ``tensor``, sharded as it is where that
    can be (a transpose of a DTensor is one), else whole on every rank: another function
    runs on the gathered tensor (a collective over the ranks that shard it), and DCP writes
    the replicated result once."""
    if transform.transpose is not None:
        return transform.file_tensor(tensor).contiguous()
    if is_dtensor(tensor):
        tensor = tensor.full_tensor()  # type: ignore[attr-defined]
    return transform.file_tensor(tensor).contiguous()


def export_live(models: Mapping[str, nn.Module], path: Path, format: ExportFormat,
                map_key: KeyMap | None, dtype: torch.dtype | None, max_shard_bytes: int,
                files: Files, overwrite: bool = False,
                state_of: StateOf = model_state_dict) -> dict[str, Path]:
    """Write every model's weights from a running trainer (collective) to the directory
    ``path`` of a filesystem the ranks share (``files``); see ``SetupMixin.export_weights``
    for the layout. ``state_of(model)`` gives what is written of each model.

    Returns:
        What was written for each model: its Hugging Face directory, or its file.

    Raises:
        FileExistsError: on every rank, if ``path`` is not empty and ``overwrite`` is False.
    """
    from torch.distributed.checkpoint import HuggingFaceStorageWriter, save

    if format not in ("hf", "safetensors"):
        raise ValueError(f"format={format!r}: expected 'hf' (Hugging Face layout) or "
                         "'safetensors' (one file per model, the trainer's keys)")
    check_out_dir_on_rank_zero(path, overwrite, files)
    written = {}
    for name, model in models.items():
        hf = format == "hf"
        state = exported_state(name, model, map_key if hf else None, dtype,
                               model_rules(model) if hf else None, state_of)
        target = export_paths(path, name, format, several=len(models) > 1,
                              make_room=is_rank_zero())
        if format == "hf":
            # Every rank plans the same shards: under a pipeline each holds other keys.
            sizes = _on_every_rank({key: tensor.numel() * tensor.element_size()
                                    for key, tensor in state.items()})
            shards = plan_shards(sizes, max_shard_bytes)
        else:
            shards = [list(state)]
        staging = _shared_staging(path, name)
        try:
            # Every rank writes through its descriptor of the one staging directory.
            writer = HuggingFaceStorageWriter(
                str(staging.path), save_distributed=True, enable_consolidation=True,
                fqn_to_index_mapping={key: number
                                      for number, keys in enumerate(shards, start=1)
                                      for key in keys})
            with warnings.catch_warnings():
                # One process is a valid case here; DCP warns that it assumes so.
                warnings.filterwarnings("ignore", message="torch.distributed is disabled")
                save(state, storage_writer=writer)
            if is_rank_zero():
                with staging:  # emptied and removed if publishing fails
                    _publish(staging, target, len(shards), model if format == "hf" else None)
        finally:
            staging.close()
        barrier()
        logger.info("exported %s to %s", name, target)
        written[name] = target
    return written


def check_out_dir(out_dir: Any, overwrite: bool, files: Files) -> None:
    """Refuse to export into ``out_dir`` unless it is new or empty, or ``overwrite`` is set.

    Raises:
        FileExistsError: naming the directory, what it holds, and the fix.
    """
    # A dangling link is neither a file nor a directory to ``files``, yet it is in the way.
    dangling = isinstance(out_dir, Path) and out_dir.is_symlink() and not out_dir.exists()
    if dangling or files.is_file(out_dir):
        raise FileExistsError(f"export target {out_dir} exists and is not a directory: name a "
                              "directory (it is created if missing)")
    held = sorted(name for name, _ in itertools.islice(files.list_dir(out_dir), 4))
    if held and not overwrite:
        raise FileExistsError(
            f"export target {out_dir} is not empty (it holds {', '.join(held[:3])}"
            f"{', ...' if len(held) > 3 else ''}): choose a new or empty directory, or pass "
            "overwrite=True (--overwrite on the command line) to replace the weight files of "
            "an earlier export there (other files stay, nothing outside it is touched)")


def export_paths(out_dir: Path, model: str, format: ExportFormat, several: bool,
                 make_room: bool) -> Path:
    """Where ``model`` is exported inside ``out_dir``: its file, or its Hugging Face
    directory (``out_dir`` itself unless there are ``several`` models).

    Args:
        make_room: Remove what is in the way: the staging directories a failed export left,
            and a link or file where the model's directory goes (a link is removed, never
            followed out of ``out_dir``). A model's file is replaced by a rename, which
            never follows one.

    Raises:
        LinkRefused: if ``out_dir`` is created here and a link takes its place.
    """
    if format == "safetensors":
        target = out_dir / f"{model}.safetensors"
    else:
        target = out_dir / model if several else out_dir
    if make_room:
        directory = open_dir(out_dir, create=True, follow=True)
        try:
            prefix = staging_prefix(model)
            for name in os.listdir(directory):
                if name == prefix or name.startswith(f"{prefix}."):
                    with contextlib.suppress(OSError):  # leftovers: the next export retries
                        clear(directory, name)
            if target != out_dir and format == "hf":
                clear(directory, target.name, keep_directory=True)
        finally:
            os.close(directory)
    return target


def clear(directory: int, name: str, keep_directory: bool = False) -> None:
    """Remove the entry ``name`` of the directory open as ``directory``: a file or link
    (removed, never followed), or a directory tree unless ``keep_directory``."""
    try:
        mode = os.stat(name, dir_fd=directory, follow_symlinks=False).st_mode
    except FileNotFoundError:
        return
    if not stat.S_ISDIR(mode):
        os.unlink(name, dir_fd=directory)
    elif not keep_directory:
        shutil.rmtree(name, dir_fd=directory)  # by descriptor: follows no link inside


def _shared_staging(out_dir: Path, model: str) -> Staging:
    """The staging directory rank 0 creates and every rank opens (collective)."""
    staging: Staging | None = None
    problem: Exception | None = None
    if is_rank_zero():
        try:
            staging = Staging(out_dir, model)
        except (OSError, CheckpointError) as exc:
            problem = exc
    shared = from_rank_zero(problem or (staging.name if staging is not None else None))
    if isinstance(shared, Exception):
        raise shared
    return staging if staging is not None else Staging(out_dir, model, name=shared)


def _publish(staging: Staging, target: Path, count: int, model: nn.Module | None) -> None:
    """Give the consolidated files their final names and move them to ``target``; a
    directory target keeps its other files (a tokenizer) but loses its old weight files."""
    staging.remove("sharded")
    produced = sorted(name for name in staging.names() if name.endswith(".safetensors"))
    if model is None:  # one file per model
        for name in staging.names():
            if name != produced[0]:
                staging.remove(name)
        replace_file(staging, produced[0], target)
        return
    if count == 1:
        staging.move(produced[0], staging.fd, WEIGHTS)
        staging.remove(INDEX)
    write_model_config(model, staging.path)
    replace_weights(staging, target)


def write_model_config(model: nn.Module, directory: Path) -> None:
    """Write what ``from_pretrained`` reads besides the weights of a ``transformers`` model
    (wrapped or split into stages as a run holds it): ``config.json`` and, for a model
    that can generate (a causal LM), its generation defaults, as ``save_pretrained`` does.
    Nothing for another module."""
    root = unwrap_ddp(model)
    if isinstance(root, PipelineStages):  # rank 0's stages: the first is the model's class
        root = unwrap_stage(root.stages[0])
    if not is_hf_model(root):
        return
    root.config.to_json_file(str(directory / CONFIG))  # type: ignore[operator,union-attr]
    generation = getattr(root, "generation_config", None)
    if generation is not None and root.can_generate():  # type: ignore[operator]
        generation.save_pretrained(str(directory))


def replace_weights(staging: Staging, target: Path) -> None:
    """Move the files of ``staging`` into ``target`` (its ``out_dir``, or a directory
    directly in it) and remove ``staging``.

    The weights are written completely elsewhere first, so a failed export leaves the old
    ones intact; the old weight files of ``target`` go only once the new ones exist, while
    its other files (a tokenizer, a config) stay. Everything goes through descriptors:
    entries are unlinked and renamed, so a link in ``target`` is replaced, never written
    through, and a link planted as ``target`` or as the staging name is never followed.

    Raises:
        CheckpointError: if the staging name no longer names the staging directory.
        LinkRefused: if ``target`` is a link.
    """
    staging.check()
    directory = staging.open_out()
    try:
        if target != staging.out_dir:
            with contextlib.suppress(FileExistsError):
                os.mkdir(target.name, dir_fd=directory)
            inner = open_inside(directory, target.name, target)
            os.close(directory)
            directory = inner
        for name in os.listdir(directory):
            if is_weight_file(name):
                clear(directory, name, keep_directory=True)
        for name in staging.names():
            staging.move(name, directory)
    finally:
        os.close(directory)
    staging.finish()


def replace_file(staging: Staging, name: str, target: Path) -> None:
    """Rename the file ``name`` of ``staging`` to ``target`` (in its ``out_dir``; a link
    there is replaced, never followed), and remove ``staging``.

    Raises:
        CheckpointError: if the staging name no longer names the staging directory.
    """
    staging.check()
    directory = staging.open_out()
    try:
        staging.move(name, directory, target.name)
    finally:
        os.close(directory)
    staging.finish()


def check_out_dir_on_rank_zero(out_dir: Any, overwrite: bool, files: Files) -> None:
    """``check_out_dir`` on rank 0, raised on every rank (collective), before any write."""
    problem = None
    if is_rank_zero():
        try:
            check_out_dir(out_dir, overwrite, files)
        except FileExistsError as exc:
            problem = str(exc)
    problem = from_rank_zero(problem)
    if problem is not None:
        raise FileExistsError(problem)


def _on_every_rank(sizes: dict[str, int]) -> dict[str, int]:
    """The union of every rank's ``{key: bytes}``, in key order of the ranks (collective)."""
    return {key: size for view in gather_objects(sizes) for key, size in view.items()}
