"""The trainer's full state as torch Distributed Checkpoint (DCP) saves and loads it.

DCP keeps what it can shard and reshard by name in its own structure: the models' and
optimizers' tensors by parameter name, and the loop's counters and the callbacks' states
(an EMA callback's averages by parameter name, so each shard or pipeline stage saves its
own). The user's extra state and the schedulers are Python objects stored as one opaque blob,
their tensors (if any) saved beside it by path: DCP would otherwise flatten their dicts and
lists into one key per element and refuse to load a list that grew or a key that an older
checkpoint lacks. That blob is shared (written once; every rank holds the same); each process
also writes a blob of its own, under its own key, with its random generators and
``rank_state_dict()``, and each data-parallel rank its position in a stateful train loader.
"""

from __future__ import annotations

import copy
import hashlib
import io
import pickle
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from dream_trainer.checkpoint.directory import CheckpointError
from dream_trainer.checkpoint.rng import rng_state
from dream_trainer.checkpoint.tensor_ref import TensorRef
from dream_trainer.checkpoint.torch_archive import rebuild
from dream_trainer.checkpoint.trust import load_item
from dream_trainer.parallel.state_dict import load_model_state_dict, model_state_dict
from dream_trainer.trainer.phases import call_through

if TYPE_CHECKING:
    from dream_trainer.trainer.abstract import AbstractTrainer

SHARED = "objects"
"""Key (under ``state.``) of the blob every rank holds the same."""
TENSORS = "tensors"
"""Key (under ``state.``) of the tensors taken out of that blob, by path."""


def split_tensors(value: Any, path: str, tensors: dict[str, torch.Tensor]) -> Any:
    """``value`` with every tensor replaced by a ``TensorRef``, the tensors put in
    ``tensors`` by path (containers keep their types)."""
    if isinstance(value, torch.Tensor):
        tensors[path] = value
        return TensorRef(path)
    if isinstance(value, dict):
        split = copy.copy(value)  # keeps the subclass (OrderedDict, defaultdict)
        for key, item in value.items():
            split[key] = split_tensors(item, _join(path, key), tensors)
        return split
    if isinstance(value, (list, tuple)):
        items = [split_tensors(item, _join(path, index), tensors)
                 for index, item in enumerate(value)]
        if isinstance(value, tuple) and hasattr(value, "_fields"):
            return type(value)(*items)
        return type(value)(items)
    return value


def _join(path: str, key: Any) -> str:
    return f"{path}.{key}" if path else str(key)


def join_tensors(value: Any, tensors: Mapping[str, torch.Tensor]) -> Any:
    """The inverse of ``split_tensors``. Iterative, and linear in ``value`` as decoded: the
    decoder bounds its size counting every shared reference (``checkpoint.budget``)."""
    return rebuild(value, lambda leaf: tensors[leaf.path] if isinstance(leaf, TensorRef)
                   else leaf)


LOADER = "loader_dp"
"""Key prefix (under ``state.``) of each data-parallel rank's position in a stateful train
loader, written by every rank of that index (tensor-parallel peers read alike)."""


def rank_key(rank: int) -> str:
    """Key (under ``state.``) of one process's own blob: its generators and user state."""
    return f"rank{rank}"


def pack(value: Any) -> bytes:
    """``value`` (tensors included) as bytes that DCP stores whole."""
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def unpack(blob: bytes, device: torch.device, source: str, trusted: Iterable[str] = ()) -> Any:
    """The object ``pack`` turned into ``blob``, unpickled through the allowlist; its tensors
    land on ``device``.

    Raises:
        CheckpointError: naming a refused type and ``source``.
    """
    return load_item(blob, source, trusted, map_location=device)


def digest(value: Any) -> str:
    """A hash of ``value``'s contents that is the same on every rank for equal values
    (tensors are hashed by dtype, shape and bytes, wherever they live)."""
    hasher = hashlib.sha256()
    _feed(hasher, value)
    return hasher.hexdigest()


def _feed(hasher: Any, value: Any) -> None:
    if isinstance(value, torch.Tensor):
        tensor = value.detach().cpu().contiguous()
        hasher.update(f"tensor{tensor.dtype}{tuple(tensor.shape)}".encode())
        hasher.update(tensor.reshape(-1).view(torch.uint8).numpy().tobytes()
                      if tensor.numel() else b"")
    elif isinstance(value, Mapping):
        hasher.update(f"map{len(value)}".encode())
        for key in sorted(value, key=repr):
            _feed(hasher, key)
            _feed(hasher, value[key])
    elif isinstance(value, (list, tuple)):
        hasher.update(f"{type(value).__name__}{len(value)}".encode())
        for item in value:
            _feed(hasher, item)
    else:
        hasher.update(pickle.dumps(value))


def optimizer_owner(trainer: AbstractTrainer, name: str,
                    optimizer: torch.optim.Optimizer) -> nn.Module:
    """The model whose parameters ``optimizer`` updates (needed to name its state by FQN).

    Raises:
        CheckpointError: if the optimizer spans several models or none.
    """
    wanted = {id(p) for group in optimizer.param_groups for p in group["params"]}
    for model in trainer.named_models().values():
        if wanted <= {id(p) for p in model.parameters()}:
            return model
    raise CheckpointError(
        f"optimizer {name!r} updates parameters that do not all belong to one model: give "
        "each model its own optimizer so its state can be saved and resharded by name"
    )


class TrainingState:
    """Models, optimizers, schedulers, trainer counters and callbacks, and per-rank state.

    Model and optimizer states come from ``model_state_dict`` (torch's
    ``get_model_state_dict``, or the model's own keys where a state-dict hook renames them)
    and ``get_optimizer_state_dict``, so they are keyed by parameter name and sharded as the
    model is (DDP, FSDP2, TP), which lets DCP load them into a different number of ranks.

    Optimizer states are flattened (one entry per parameter and setting, e.g.
    ``param_groups.layers.0.w.lr``) when ``flat_optimizers``: pipeline stages hold different
    parameters, and DCP keeps only one rank's copy of a nested ``param_groups`` list, so the
    other stages would load foreign groups. Runs without a pipeline keep the nested form.

    Args:
        trainer: The trainer whose state this is.
        weights_only: Only the models (fine-tuning from another run).
        saved: When loading, the checkpoint's ``{key: metadata}``: a per-rank blob is only
            asked for when present (a checkpoint written by fewer ranks has none for this
            rank), and the blob's tensors are loaded into the live ones where they still
            exist (in place, sharded), else into new tensors of the saved size.
        flat_optimizers: Save (or load) optimizer states in the flattened form; by default
            the layout's (``Layout.flat_optimizers``: under a pipeline).
        source: The checkpoint loaded from, named when one of its values is refused.
        trusted: Globals its packed values may unpickle besides the allowlist (see
            ``checkpoint.trust``).
        left_out: ``{model name: state keys}`` neither saved nor loaded: frozen weights
            that a resume reads from their source again (``checkpoint.frozen``).

    Attributes:
        loaded_rng: After loading, this rank's saved random generator states: those the rank
            of the same number saved, or None when the checkpoint was written by fewer ranks.
        saved_world_size: After loading (not ``weights_only``), how many processes wrote the
            checkpoint. On another number, per-rank streams cannot all carry over.
    """

    def __init__(self, trainer: AbstractTrainer, weights_only: bool = False,
                 saved: Mapping[str, Any] | None = None,
                 flat_optimizers: bool | None = None, source: str = "",
                 trusted: Iterable[str] = (),
                 left_out: Mapping[str, Iterable[str]] | None = None) -> None:
        self.trainer = trainer
        self.left_out = {name: set(keys) for name, keys in (left_out or {}).items()}
        self.source = source
        self.trusted = tuple(trusted)
        self.weights_only = weights_only
        self.saved = saved
        self.flat_optimizers = trainer.layout.flat_optimizers if flat_optimizers is None \
            else flat_optimizers
        self.loaded_rng: dict[str, Any] | None = None
        self.saved_world_size: int | None = None
        self.resumed_mid_epoch = False

    def _unpack(self, blob: bytes, key: str) -> Any:
        return unpack(blob, self.trainer.world.device,
                      f"checkpoint {self.source} (item state.{key})", self.trusted)

    # DCP's state-dict helpers are imported where used: the package takes about a second to
    # import. DCP recognizes this class as its Stateful protocol by its two methods.

    def state_dict(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        trainer = self.trainer
        state: dict[str, Any] = {"models": {
            name: {key: value for key, value in model_state_dict(model).items()
                   if key not in self.left_out.get(name, ())}
            for name, model in trainer.named_models().items()}}
        if self.weights_only:
            return state
        options = self._options()
        state["optimizers"] = {
            name: get_optimizer_state_dict(optimizer_owner(trainer, name, opt), opt,
                                           options=options)
            for name, opt in trainer.named_optimizers().items()}
        tensors: dict[str, torch.Tensor] = {}
        state[SHARED] = pack(split_tensors({
            "schedulers": {name: scheduler.state_dict()
                           for name, scheduler in trainer.named_schedulers().items()},
            "extra": call_through(trainer, "extra_state_dict"),
            "world_size": trainer.world.world_size,
        }, "", tensors))
        # The loop's counters and the callbacks' states stay in DCP's own structure: a
        # callback's tensors (EMA's averages) are keyed by parameter name, so each pipeline
        # stage or shard saves its own and a run on another layout loads them by name.
        state["trainer"] = trainer.state_dict() if self.saved is None \
            else self._saved_entries(trainer.state_dict())
        state[TENSORS] = tensors if self.saved is None else self._load_targets(tensors)
        if self.saved is None:
            position = trainer.data_state_dict()
            if position is not None:
                state[f"{LOADER}{trainer.world.dp_rank}"] = pack(position)
        else:  # every saved rank's position: another topology may need them all
            for key in self.saved:
                if key.startswith(f"state.{LOADER}"):
                    state[key.removeprefix("state.")] = b""
        key = rank_key(trainer.world.rank)
        if self.saved is None or f"state.{key}" in self.saved:
            state[key] = pack({"rng": rng_state(),
                               "user": call_through(trainer, "rank_state_dict")})
        return state

    def _saved_entries(self, loop: dict[str, Any]) -> dict[str, Any]:
        """The entries of the loop's state that the checkpoint has: one written before an
        entry was added lacks it (DCP would refuse the load), and the loop's
        ``load_state_dict`` treats it as absent."""
        assert self.saved is not None
        prefix = "state.trainer."
        saved = {key.removeprefix(prefix).split(".")[0] for key in self.saved
                 if key.startswith(prefix)}
        return {key: value for key, value in loop.items() if key in saved}

    def _load_targets(self, live: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """A tensor for every saved one: the live tensor at its path if it has its shape."""
        assert self.saved is not None
        prefix = f"state.{TENSORS}."
        targets = {}
        for key, meta in self.saved.items():
            if not key.startswith(prefix) or not hasattr(meta, "size"):
                continue
            path = key.removeprefix(prefix)
            current = live.get(path)
            targets[path] = current if current is not None \
                and tuple(current.shape) == tuple(meta.size) \
                else torch.empty(tuple(meta.size), dtype=meta.properties.dtype)
        return targets

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

        trainer = self.trainer
        for name, model in trainer.named_models().items():
            load_model_state_dict(model, state_dict["models"][name],
                                  strict=not self.left_out.get(name))
        if self.weights_only:
            return
        options = self._options()
        for name, optimizer in trainer.named_optimizers().items():
            set_optimizer_state_dict(optimizer_owner(trainer, name, optimizer), optimizer,
                                     state_dict["optimizers"][name], options=options)
        shared = join_tensors(self._unpack(state_dict[SHARED], SHARED),
                              state_dict.get(TENSORS, {}))
        for name, scheduler in trainer.named_schedulers().items():
            if name not in shared["schedulers"]:
                raise CheckpointError(f"the checkpoint has no state for scheduler {name!r} "
                                      f"(it has {sorted(shared['schedulers'])})")
            scheduler.load_state_dict(shared["schedulers"][name])
        trainer.load_state_dict(state_dict["trainer"])
        positions = {int(key.removeprefix(LOADER)): self._unpack(blob, key)
                     for key, blob in state_dict.items() if key.startswith(LOADER)}
        try:
            trainer.load_data_state_dict(positions, int(state_dict["trainer"]["dp_size"]))
        except ValueError as exc:
            raise CheckpointError(str(exc)) from exc
        call_through(trainer, "load_extra_state_dict", shared["extra"])
        self.resumed_mid_epoch = int(state_dict["trainer"].get("batch_in_epoch", 0)) > 0
        own = state_dict.get(rank_key(trainer.world.rank))
        mine = self._unpack(own, rank_key(trainer.world.rank)) if own is not None else None
        self.loaded_rng = None if mine is None else mine["rng"]
        saved_world = self.saved_world_size = int(shared["world_size"])
        if saved_world == trainer.world.world_size and mine is not None:
            call_through(trainer, "load_rank_state_dict", mine["user"])
        elif call_through(trainer, "rank_state_dict"):
            raise CheckpointError(
                f"the checkpoint keeps per-rank state (rank_state_dict) for {saved_world} "
                f"processes, and this run has {trainer.world.world_size}: each process's "
                "state can only go back to the same process; resume with "
                f"{saved_world} processes, or from a checkpoint without per-rank state"
            )

    def _options(self) -> Any:
        from torch.distributed.checkpoint.state_dict import StateDictOptions

        return StateDictOptions(flatten_optimizer_state_dict=self.flat_optimizers)


def check_shared(gathered: list[dict[str, str]]) -> None:
    """Refuse to save shared extra state that differs between ranks.

    Args:
        gathered: Every rank's ``{key: digest(value)}`` of its ``extra_state_dict()``.

    Raises:
        CheckpointError: naming the keys whose values differ.
    """
    differing = sorted({key for digests in gathered for key in digests
                        if len({other.get(key) for other in gathered}) > 1})
    if differing:
        raise CheckpointError(
            f"extra_state_dict() returns {', '.join(map(repr, differing))} with different "
            "values on different ranks, but it is saved once, as state every rank shares: "
            "only one rank's value would come back on resume. Return per-rank state from "
            "rank_state_dict() instead (saved for each rank and restored to the same rank)"
        )
