"""Checkpoints the size of what trains: frozen weights that came from ``init_weights_from``
are left out and their source recorded, so that a resume reads them from there again.

A LoRA run trains a few million adapter weights on a base of billions that never changes;
writing the base at every checkpoint costs its size in time and storage each time. The
checkpoint instead records, in ``models.json``, each model's sources (the directories, in
the order they were read), a checksum of their files and the keys it left out; a resume
reads the base from the source again (the run's own ``init_weights_from``, or the recorded
paths when the run names none) and refuses a source whose files changed, naming both.

``models.json`` also keeps each peft model's adapter config, so that ``dream-trainer export
--format peft`` can write an adapter from the checkpoint alone.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from dream_trainer.checkpoint.models_record import (FrozenSource, check_same_source,
                                                    read_record, recorded_paths,
                                                    source_checksum, write_record)
from dream_trainer.checkpoint.storage_base import Location
from dream_trainer.errors import CheckpointError
from dream_trainer.parallel.state_dict import frozen_keys
from dream_trainer.world.agree import gather_objects

if TYPE_CHECKING:
    from dream_trainer.checkpoint.pretrained import PretrainedWeights
    from dream_trainer.weights.keys import KeyMap


def adapter_configs(models: Mapping[str, nn.Module]) -> dict[str, dict[str, Any]]:
    """``{model name: {adapter name: config as a dict}}`` for the peft models among
    ``models`` (found by their ``peft_config``; peft is never imported)."""
    found: dict[str, dict[str, Any]] = {}
    for name, model in models.items():
        for module in model.modules():
            held = getattr(module, "peft_config", None)
            if isinstance(held, dict) and all(hasattr(config, "to_dict")
                                              for config in held.values()):
                found[name] = {adapter: config.to_dict() for adapter, config in held.items()}
                break
    return found


class FrozenWeights:
    """The frozen weights that a run's checkpoints leave out, and their check on resume.

    A model's weights are left out when they do not require gradients and
    ``init_weights_from`` set them; ``save_all`` (``save_frozen_weights``) keeps them all.
    Collective when it has to checksum a source (every rank constructs it).

    Args:
        models: The trainer's built models by name.
        plan: The run's ``PretrainedWeights`` after its load, or None.
        map_key: ``map_pretrained_key``, to read a recorded source again.
        strict: ``init_weights_strict``, likewise.
        save_all: Keep the frozen weights in the checkpoints.
        device: The ranks' device, for their agreement when a source is read again.
    """

    def __init__(self, models: Mapping[str, nn.Module], plan: PretrainedWeights | None,
                 map_key: KeyMap, strict: bool, save_all: bool,
                 device: torch.device = torch.device("cpu")) -> None:
        self.models = models
        self.device = device
        self.map_key = map_key
        self.strict = strict
        self.save_all = save_all
        self.sources: dict[str, FrozenSource] = {}
        if plan is None or save_all:
            return
        for name in models:
            if name in plan.loaded:
                source = self._source(name, plan.paths(name), plan.loaded[name])
                if source is not None:
                    self.sources[name] = source

    @classmethod
    def of(cls, trainer: Any) -> FrozenWeights:
        """The trainer's: its models, its ``init_weights_from`` load (``SetupMixin``'s plan,
        kept after the load), key map and strictness, and ``save_frozen_weights``."""
        config = trainer.config
        return cls(trainer.named_models(), getattr(trainer, "_weights_plan", None),
                   getattr(trainer, "map_pretrained_key", lambda model, key: key),
                   getattr(config, "init_weights_strict", True),
                   config.checkpoint_parameters.save_frozen_weights, trainer.world.device)

    def _source(self, name: str, paths: list[Location],
                loaded: set[str]) -> FrozenSource | None:
        """The record of model ``name``'s frozen weights that ``paths`` set (collective)."""
        mine = sorted(loaded & frozen_keys(self.models[name]))
        # A pipeline stage holds some keys only: every rank records all of them.
        keys = sorted({key for share in gather_objects(mine) for key in share})
        if not keys:
            return None
        return FrozenSource(tuple(map(str, paths)), source_checksum(paths), tuple(keys))

    def left_out(self) -> dict[str, tuple[str, ...]]:
        """``{model name: state keys}`` that a save leaves out."""
        return {name: source.keys for name, source in self.sources.items()}

    def write(self, directory: Location) -> None:
        """Record the sources and adapter configs in the checkpoint at ``directory``."""
        adapters = adapter_configs(self.models)
        if self.sources or adapters:
            write_record(directory, self.sources, adapters)

    def resume(self, checkpoint: Location) -> dict[str, tuple[str, ...]]:
        """Check (and where this run names no source, read) the frozen weights that the
        checkpoint left out; return them, to be left out of the load too (collective).

        Raises:
            CheckpointError: for a model the checkpoint records that this run lacks, a
                source whose files differ from the recorded ones (naming both), or keys the
                source does not set.
        """
        recorded, _ = read_record(checkpoint)
        for name, saved in recorded.items():
            if name not in self.models:
                raise CheckpointError(f"checkpoint {checkpoint} records frozen weights of "
                                      f"model {name!r}, which this run does not create")
            current = self.sources.get(name)
            if current is None:
                current = self._read_again(name, recorded_paths(saved))
            check_same_source(checkpoint, name, saved, current)
            if not self.save_all:
                self.sources[name] = current
        return {name: saved.keys for name, saved in recorded.items()}

    def _read_again(self, name: str, paths: list[Location]) -> FrozenSource:
        """Load the recorded source into model ``name``: a run that resumes without
        ``init_weights_from`` gets its base from where the checkpoint says it came."""
        from dream_trainer.checkpoint.pretrained import PretrainedWeights

        plan = PretrainedWeights({name: self.models[name]}, {name: paths}, self.map_key,
                                 self.strict)
        plan.load(device=self.device)
        source = self._source(name, paths, plan.loaded[name])
        return source if source is not None else FrozenSource(
            tuple(map(str, paths)), "", ())
