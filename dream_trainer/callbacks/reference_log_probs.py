"""``ReferenceLogProbs``: a frozen model's log-probabilities of every training sample, computed in
one pass before the first step and kept with the run, so that the model can leave memory
while the policy trains (DPO's reference)."""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn
from typing_extensions import override

from dream_trainer.checkpoint.storage import storage_for
from dream_trainer.errors import CheckpointError
from dream_trainer.parallel.dtensor import local_tensor
from dream_trainer.trainer.callback import Callback
from dream_trainer.utils.bounded import read_bounded
from dream_trainer.world.agree import gather_objects

logger = logging.getLogger(__name__)

Compute = Callable[[Any, nn.Module, Any], torch.Tensor]
"""``(trainer, model, batch) -> [items, k]``: the model's values for a batch of items."""


class ReferenceLogProbs(Callback):
    """Compute a frozen model's values (a reference model's summed log-probs of each pair's
    chosen and rejected answers) for every item of the training set once, before the first
    step, and serve them by item index while the policy trains.

    The pass runs in ``pre_fit`` on every rank: each data-parallel rank takes every
    ``dp_size``-th item, batches of ``batch_size`` through ``compute`` (which calls the model
    through ``trainer.forward_loss``, so every layout's collectives run alike), and the ranks
    then share the table. With checkpointing it is written beside the checkpoints
    (``<checkpoint_dir>/reference_log_probs/<model>.safetensors``, with a SHA-256 in a JSON
    file beside it): a resumed run reads it instead of computing again, and refuses one whose
    bytes changed. ``release=True`` then frees the storage of the model's parameters (a
    shard's under FSDP2): it must be frozen and never called again, and with checkpointing its
    weights must come from ``init_weights_from`` with ``save_frozen_weights=False``, so that
    the checkpoints leave them out.

    Args:
        model: The attribute of the frozen model, e.g. ``"reference"``.
        dataset: The training items (indexable, with ``len``), in the order of their indices.
        collate: Items -> the batch ``compute`` takes (``PreferenceDataset.collate``).
        compute: ``(trainer, model, batch) -> [items, k]`` float tensor, the same on every
            rank of a data-parallel group.
        batch_size: Items per batch of the pass.
        release: Free the model's storage after the pass.

    Raises:
        ValueError: for a ``batch_size`` below 1; in ``pre_fit``, for a model with trainable
            parameters, or ``release=True`` for weights the checkpoints would save.
    """

    def __init__(self, model: str, dataset: Sequence[Any], collate: Callable[[list[Any]], Any],
                 compute: Compute, batch_size: int = 8, release: bool = True) -> None:
        if batch_size < 1:
            raise ValueError(f"ReferenceLogProbs(batch_size={batch_size}): give at least 1")
        self.model = model
        self.dataset = dataset
        self.collate = collate
        self.compute = compute
        self.batch_size = batch_size
        self.release = release
        self.table: torch.Tensor | None = None
        self.computed = False
        """Whether this run computed the table (False: read from an earlier run's file)."""

    def lookup(self, indices: torch.Tensor) -> torch.Tensor:
        """The values of the items ``indices`` (``[items]``), on the trainer's device.

        Raises:
            RuntimeError: before the pass (``pre_fit``) has run.
        """
        if self.table is None:
            raise RuntimeError("ReferenceLogProbs.lookup before the pass: it runs in pre_fit, "
                               "before the first training step")
        return self.table[indices.cpu()].to(self.trainer.world.device)

    @override
    def pre_fit(self) -> None:
        model = self.trainer.named_models()[self.model]
        if any(param.requires_grad for param in model.parameters()):
            raise ValueError(f"ReferenceLogProbs({self.model!r}): the model has trainable "
                             "parameters; it computes a frozen model's values once "
                             f"(self.{self.model}.requires_grad_(False) in configure_models)")
        if self.release:
            self._check_release()
        stored = self._read()
        if stored is None:
            self.table = self._pass(model)
            self.computed = True
            self._write(self.table)
        else:
            self.table = stored
        if self.release:
            # Each parameter's storage (a shard's padded buffer under FSDP2) is freed; the
            # parameters stay, empty, so the model keeps its place among the trainer's.
            for param in model.parameters():
                local_tensor(param).untyped_storage().resize_(0)

    def _check_release(self) -> None:
        """Freed weights must never be saved: the checkpoints must leave them out, which
        they do for frozen weights that ``init_weights_from`` set."""
        config = self.trainer.config
        parameters = getattr(config, "checkpoint_parameters", None)
        if parameters is None or not parameters.enabled:
            return  # nothing is saved
        sources = getattr(config, "init_weights_from", None)
        named = sources is not None and (not isinstance(sources, Mapping)
                                         or self.model in sources)
        if not named or parameters.save_frozen_weights:
            raise ValueError(
                f"ReferenceLogProbs({self.model!r}, release=True) frees the model's weights, "
                "which the checkpoints must then leave out: set its weights with "
                f"init_weights_from (e.g. {{{self.model!r}: base_dir}}) and keep "
                "save_frozen_weights=False, or pass release=False")

    # -- the pass ---------------------------------------------------------------------------
    def _pass(self, model: nn.Module) -> torch.Tensor:
        world = self.trainer.world
        mine = list(range(world.data_shard, len(self.dataset), world.data_shards))
        batches = -(-len(range(0, len(self.dataset), world.data_shards)) // self.batch_size)
        found: dict[int, torch.Tensor] = {}
        was_training = model.training
        model.eval()
        for number in range(batches):  # every rank runs as many batches (collectives)
            chunk = mine[number * self.batch_size:(number + 1) * self.batch_size]
            # A rank short of items repeats its first (or item 0) and drops the result.
            padded = chunk + [chunk[0] if chunk else 0] * (self.batch_size - len(chunk))
            with torch.no_grad():
                values = self.compute(self.trainer, model, self.collate(
                    [self.dataset[index] for index in padded]))
            for index, value in zip(chunk, values.detach().float().cpu()):
                found[index] = value
        model.train(was_training)
        table: dict[int, torch.Tensor] = {}
        for share in gather_objects(found):
            table.update(share)
        return torch.stack([table[index] for index in range(len(self.dataset))])

    # -- kept with the run ------------------------------------------------------------------
    def _paths(self) -> tuple[Any, Any] | None:
        directory = getattr(self.trainer, "checkpoint_dir", None)
        parameters = getattr(self.trainer.config, "checkpoint_parameters", None)
        if directory is None or parameters is None or not parameters.enabled:
            return None
        folder = directory / "reference_log_probs"
        return folder / f"{self.model}.safetensors", folder / f"{self.model}.json"

    def _write(self, table: torch.Tensor) -> None:
        paths = self._paths()
        if paths is None or not self.trainer.world.is_rank_zero:
            return
        from safetensors.torch import save

        data = save({"values": table.contiguous()})
        record = {"items": len(self.dataset), "sha256": hashlib.sha256(data).hexdigest()}
        storage = storage_for(paths[0])
        storage.make_dir(paths[0].parent)
        storage.write_bytes(paths[0], data)
        storage.write_bytes(paths[1], json.dumps(record).encode())  # last: marks it complete

    def _read(self) -> torch.Tensor | None:
        """An earlier pass's table of this run, checked (every rank reads it), or None."""
        paths = self._paths()
        if paths is None:
            return None
        storage = storage_for(paths[1])
        if not storage.is_file(paths[1]):
            return None
        from safetensors.torch import load

        with storage.open_file(paths[1]) as handle:
            record = json.loads(read_bounded(handle, paths[1]))
        with storage.open(paths[0]) as handle:
            data = handle.read()
        if hashlib.sha256(data).hexdigest() != record.get("sha256") \
                or record.get("items") != len(self.dataset):
            raise CheckpointError(
                f"{paths[0]} does not match {paths[1]} (its checksum, or {len(self.dataset)} "
                "items): it changed since this run wrote it, or the training set did; delete "
                "both files to compute the values again")
        logger.info("read the %s values of %d items from %s", self.model, len(self.dataset),
                    paths[0])
        return load(data)["values"]
