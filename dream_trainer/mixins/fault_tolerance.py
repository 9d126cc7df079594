"""``FaultTolerantMixin``: replica groups that keep training when one of them fails (torchft)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from pydantic import Field
from torch import nn
from typing_extensions import override

from dream_trainer.configs.base import ConfigModel
from dream_trainer.configs.fault_tolerance import FaultToleranceParameters
from dream_trainer.mixins.checkpoint import CheckpointMixin
from dream_trainer.mixins.logging import LoggerMixin
from dream_trainer.trainer.base import BaseTrainer
from dream_trainer.trainer.phases import runs_on

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from dream_trainer.ft.replica_group import ReplicaGroup

logger = logging.getLogger(__name__)
# The cause an update the groups did not commit is counted under in the update vote.
VOTE_CAUSE = "fault_tolerance"

_STATE_KEY = "fault_tolerance"


class FaultTolerantConfigMixin(ConfigModel):
    """Adds ``fault_tolerance_parameters`` to a trainer config."""

    fault_tolerance_parameters: FaultToleranceParameters = Field(
        default_factory=FaultToleranceParameters)
    """The lighthouse, this group's ``replica_id``, ``min_replicas`` and the timeouts."""


class FaultTolerantMixin(BaseTrainer):
    """Train as one of several replica groups that survive the loss of any of them (torchft).

    The data-parallel replicate axis is split into replica groups, each its own launch (its
    own ``torchrun``) with its own ``replica_id``; inside a group every parallelism works as
    usual (FSDP2 inside a group and groups across it is HSDP). At the start of each optimizer
    step the groups form a quorum at the lighthouse; after the backward pass each rank
    averages its gradients with the same rank of every live group, and the optimizer steps
    only if the quorum commits the step (every rank of the group finished it without error
    and at least ``min_replicas`` groups took part). A group that fails is dropped from the
    next quorum while the others go on; started again, it copies the models, optimizers,
    schedulers, loop position and callback states from a live peer (no checkpoint is read)
    and joins the next step. Each group reads its own share of the training data.

    List it first among the trainer's bases (``class T(FaultTolerantMixin, DreamTrainer)``):
    each group then checkpoints to ``checkpoints/replica_<id>`` and logs to
    ``logs/replica_<id>``. ``global_step`` counts every optimizer step, also one that did not
    commit (a peer failed during it; its update is dropped, as ``NanGuard`` drops skipped
    ones); ``committed_steps`` counts those that did. One ``step()`` per optimizer step:
    a trainer with several optimizers must step them in one call (one optimizer over every
    parameter group).

    Needs ``pip install 'dream-trainer[ft]'`` (torchft); imported at setup.

    Raises:
        TypeError: if a checkpoint or logger mixin comes before this one in the bases.
    """

    config_mixin = FaultTolerantConfigMixin

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._check_bases()
        super().__init__(*args, **kwargs)
        params = self.fault_tolerance_parameters
        self.world.join_replica_groups(params.replica_id, params.replica_groups)
        self._replica_group: ReplicaGroup | None = None
        self._pending_ft_state: dict[str, int] | None = None
        self._quorum_ready = False
        self._stepped_in_window = False
        self._in_loop = False
        self._last_step_committed: bool | None = None
        self._recoveries = 0
        # The counters as of the latest step, still readable after teardown.
        self._committed_steps = 0
        self._participants = 0
        self.update_vote.add(VOTE_CAUSE, self._commit)

    def _check_bases(self) -> None:
        """The directory overrides only win if this class precedes the mixins that own them."""
        mro = type(self).__mro__
        first = mro.index(FaultTolerantMixin)
        late = [mixin.__name__ for mixin in (CheckpointMixin, LoggerMixin)
                if mixin in mro and mro.index(mixin) < first]
        if late:
            raise TypeError(
                f"{type(self).__name__} lists {' and '.join(late)} before FaultTolerantMixin: "
                "list FaultTolerantMixin first among the bases (class "
                f"{type(self).__name__}(FaultTolerantMixin, DreamTrainer)), so that every "
                "replica group writes checkpoints and logs to a directory of its own"
            )

    # -- what the groups share -------------------------------------------------------------
    @property
    def fault_tolerance_parameters(self) -> FaultToleranceParameters:
        return self.config.fault_tolerance_parameters  # type: ignore[attr-defined,no-any-return]

    @property
    def replica_id(self) -> int:
        """This group's index, as configured."""
        return self.fault_tolerance_parameters.replica_id

    @property
    def committed_steps(self) -> int:
        """Optimizer steps the groups have committed (0 before the first)."""
        return self._committed_steps

    @property
    def replica_participants(self) -> int:
        """Replica groups in the latest step's quorum (0 before the first quorum)."""
        return self._participants

    @property
    def last_step_committed(self) -> bool | None:
        """Whether the latest optimizer step committed (None before the first step)."""
        return self._last_step_committed

    @property
    def recoveries(self) -> int:
        """How often this process copied the live state from a peer group."""
        return self._recoveries

    @property
    def checkpoint_dir(self) -> Path:
        """Each group checkpoints on its own: ``.../checkpoints/replica_<replica_id>``."""
        return super().checkpoint_dir / f"replica_{self.replica_id}"  # type: ignore[misc]

    @property
    def log_dir(self) -> Path:
        """Each group logs on its own: ``.../logs/replica_<replica_id>``."""
        return super().log_dir / f"replica_{self.replica_id}"  # type: ignore[misc]

    # -- phases (run whether or not user hooks call super()) ----------------------------------
    @runs_on("post_setup", after_bases=True)
    def _join_replica_groups(self) -> None:
        # After the other mixins: a checkpoint is resumed first, its manager counters included.
        from dream_trainer.ft.replica_group import ReplicaGroup
        from dream_trainer.ft.wire import encode

        # A state the wire cannot carry (a callback keeping an object of its own class) is
        # refused here, naming the value, rather than when a peer first needs it.
        encode(self._recovery_state())
        self._replica_group = ReplicaGroup(
            self.fault_tolerance_parameters, self.world, self._recovery_state, self._recover,
            self._check_recovery_state, self._max_recovery_bytes)
        if self._pending_ft_state is not None:
            self._replica_group.load_state_dict(self._pending_ft_state)
            self._pending_ft_state = None

    @runs_on("pre_fit")
    def _first_quorum(self) -> None:
        # The first step's quorum, before the loop positions itself: a group that is behind
        # takes its peers' loop position here, and the loop starts from it.
        self._start_step()
        self._quorum_ready = True
        self._in_loop = True

    @runs_on("pre_train_batch")
    def _quorum_per_step(self, batch: Any, batch_idx: int) -> None:
        if batch_idx % self.training_parameters.gradient_accumulation_steps == 0:
            self._stepped_in_window = False
            if self._quorum_ready:
                self._quorum_ready = False
            else:
                self._start_step()

    def _start_step(self) -> None:
        group = self._group
        group.start_step()
        self._committed_steps, self._participants = group.committed_steps, group.participants

    @runs_on("pre_optimizer_step")
    def _reduce_across_groups(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        if self._stepped_in_window:
            raise RuntimeError(
                "step() was called twice in one optimizer step: under FaultTolerantMixin the "
                "replica groups commit each optimizer step once, so step all parameters with "
                "one optimizer (one parameter group per model) in a single step() call"
            )
        self._stepped_in_window = True
        group = self._group
        parameters = [param for param_group in optimizer.param_groups
                      for param in param_group["params"] if param.requires_grad]
        # Token-weighted gradients are summed across groups, and so are their item counts,
        # so that step() divides by the items of every live group; mean losses are averaged.
        weighted = self.item_weighting.active
        group.reduce_gradients(parameters, summed=weighted)
        if weighted:
            self.item_weighting.add_peer_counts(self.world.dp_group, group.sum_across_groups)

    def _commit(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> bool:
        """The step's vote (``update_vote``): the replica groups commit, or its update is
        dropped. Asked every step, also when another cause skips the update: the commit is
        the groups' protocol."""
        group = self._group
        committed = group.commit()
        self._last_step_committed = committed
        self._committed_steps, self._participants = group.committed_steps, group.participants
        if not committed:
            logger.warning("replica group %d: optimizer step %d did not commit (a peer failed "
                           "during it, or too few groups were live): its update is dropped",
                           self.replica_id, self.global_step + 1)
        return committed

    @runs_on("teardown")
    def _leave_replica_groups(self) -> None:
        group, self._replica_group = self._replica_group, None
        if group is not None:
            group.shutdown()

    # -- checkpoints -----------------------------------------------------------------------
    @override
    def extra_state_dict(self) -> dict[str, Any]:
        state = super().extra_state_dict()
        # Also before setup: a checkpoint is loaded into this structure, so the key must be
        # there for its saved counters to be read.
        if self._replica_group is not None:
            state[_STATE_KEY] = self._replica_group.state_dict()
        else:
            state[_STATE_KEY] = dict(self._pending_ft_state or {"step": 0,
                                                               "batches_committed": 0})
        return state

    @override
    def load_extra_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_extra_state_dict(state_dict)
        saved = state_dict.get(_STATE_KEY)
        if saved is None:
            return
        if self._replica_group is None:
            self._pending_ft_state = dict(saved)
        else:
            self._replica_group.load_state_dict(dict(saved))

    # -- live recovery ---------------------------------------------------------------------
    def _recovery_state(self) -> Any:
        """What a recovering peer copies: models, optimizers, schedulers and the trainer's
        own state (loop position, gradient scaler, callbacks). Random generators are left
        out: each group keeps its own."""
        from dream_trainer.ft.transfer import to_wire

        return to_wire({
            "models": {name: model.state_dict() for name, model in self.named_models().items()},
            "optimizers": {name: optimizer.state_dict()
                           for name, optimizer in self.named_optimizers().items()},
            "schedulers": {name: scheduler.state_dict()
                           for name, scheduler in self.named_schedulers().items()},
            "trainer": self.state_dict(),
        })

    def _check_recovery_state(self, received: Any) -> None:
        """Refuse a peer's state (on torchft's thread, before anything of it is applied)
        unless it holds this trainer's models with their exact keys, shapes, dtypes and
        layouts, the same optimizers and schedulers, and a step within ``max_steps``."""
        from dream_trainer.ft.transfer import check_fits

        sections = {"models": self.named_models(), "optimizers": self.named_optimizers(),
                    "schedulers": self.named_schedulers()}
        if not (isinstance(received, dict) and received.keys() == {*sections, "trainer"}
                and all(isinstance(received[key], dict) for key in received)):
            raise ValueError("it is not a trainer's state (a dict of models, optimizers, "
                             "schedulers and trainer)")
        for section, mine in sections.items():
            if received[section].keys() != mine.keys():
                raise ValueError(f"its {section} are {sorted(map(str, received[section]))}, "
                                 f"this trainer's {sorted(mine)}")
        for name, model in self.named_models().items():
            check_fits(model, received["models"][name], name)
        step = received["trainer"].get("global_step")
        max_steps = self.training_parameters.max_steps
        if not isinstance(step, int) or step < 0 \
                or (max_steps is not None and step > max_steps):
            raise ValueError(f"its global_step {step!r} is not a step count within "
                             f"max_steps={max_steps}")

    def _max_recovery_bytes(self) -> int:
        """The largest state a peer may send this rank: 16 times its models' local bytes
        (weights, an optimizer's moments and averages such as EMA's take a few times them)
        plus 256 MiB for the rest."""
        from dream_trainer.parallel.dtensor import local_tensor

        models = sum(local_tensor(tensor).numel() * local_tensor(tensor).element_size()
                     for model in self.named_models().values()
                     for tensor in model.state_dict().values())
        return 16 * models + 256 * 2**20

    def _recover(self, received: Any) -> None:
        """Apply a live peer's state (torchft calls it during a quorum that heals us)."""
        from dream_trainer.ft.transfer import copy_into, from_wire

        state = from_wire(received, self._mesh_named, self.world.device)
        for name, model in self.named_models().items():
            copy_into(model, state["models"][name], name)
        for name, optimizer in self.named_optimizers().items():
            optimizer.load_state_dict(state["optimizers"][name])
        for name, scheduler in self.named_schedulers().items():
            scheduler.load_state_dict(state["schedulers"][name])
        trainer_state = state["trainer"]
        if self._in_loop:
            self._continue_from(trainer_state)
        else:
            self.load_state_dict(trainer_state)
        self._recoveries += 1
        logger.warning("replica group %d recovered the live state of a peer at global step %d "
                       "(epoch %d)", self.replica_id, self.global_step, self.current_epoch)

    def _continue_from(self, peer: dict[str, Any]) -> None:
        """Take a peer's counters and callback states in the middle of the loop, keeping
        this group's data position (the groups read their shares in step, so they agree)."""
        mine = self.state_dict()
        if (mine["current_epoch"], mine["batch_in_epoch"]) != (peer["current_epoch"],
                                                              peer["batch_in_epoch"]):
            logger.warning(
                "replica group %d recovered from a peer at epoch %d, batch %d, but is itself "
                "at epoch %d, batch %d: it goes on reading its own data from there",
                self.replica_id, peer["current_epoch"], peer["batch_in_epoch"],
                mine["current_epoch"], mine["batch_in_epoch"])
        self.global_step = int(peer["global_step"])
        self.precision.load_state_dict(peer.get("precision", {}))
        self.callbacks.load_state_dict(peer.get("callbacks", {}))

    def _mesh_named(self, dims: tuple[str, ...]) -> DeviceMesh:
        mesh = self.world.mesh
        if mesh is None:
            raise RuntimeError(f"received a sharded tensor on mesh dimensions {dims}, but this "
                               "replica group has no device mesh: the groups' topologies differ")
        return mesh[dims[0] if len(dims) == 1 else dims]

    @property
    def _group(self) -> ReplicaGroup:
        if self._replica_group is None:
            raise RuntimeError("the replica group exists only between setup and teardown")
        return self._replica_group
