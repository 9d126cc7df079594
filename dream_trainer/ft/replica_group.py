"""``ReplicaGroup``: one process's membership in the torchft replica groups of a run."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from datetime import timedelta
from types import ModuleType
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from dream_trainer.configs.fault_tolerance import FaultToleranceParameters
from dream_trainer.errors import RecoveryError
from dream_trainer.ft.gradients import reduce_gradients
from dream_trainer.ft.listeners import (advertised, bound_gloo, group_store, is_wildcard,
                                        manager_server_bound_to, wildcard_warning)
from dream_trainer.ft.transport import StateTransport, secret_from_env

if TYPE_CHECKING:
    from dream_trainer.world.world import DistributedWorld

logger = logging.getLogger(__name__)

EXTRA = "ft"
"""The name of the optional dependency group that installs torchft."""


def import_torchft() -> ModuleType:
    """``torchft``, or an ImportError that says how to install it."""
    try:
        import torchft
    except ImportError as exc:
        raise ImportError(
            "fault tolerance needs torchft, which is not installed: pip install "
            f"'dream-trainer[{EXTRA}]' (torchft==0.2.0)"
        ) from exc
    return torchft


class ReplicaGroup:
    """This process's part in the replica groups: the group's store, its torchft ``Manager``
    and the process group that joins it to the same rank of every other live group.

    Global rank 0 of the group checks that the lighthouse answers (so that a wrong address
    fails within ``connect_timeout`` on every rank, naming it), and hosts a fresh store for
    the manager, so that nothing is read from an earlier attempt of the same launch.
    Every listener binds ``params.bind_address`` (see ``listeners``). Every step runs
    ``start_step`` (a quorum; a group that is behind copies the state of a live peer through
    ``StateTransport``, checks it and applies it with ``load_state_dict``), then
    ``reduce_gradients`` and ``commit``.

    Args:
        params: The fault-tolerance settings.
        world: The launched topology of this replica group.
        state_dict: Returns the state a recovering peer copies (called on torchft's thread
            while the training thread waits for the quorum).
        load_state_dict: Applies a state copied from a peer (on the training thread).
        check_state: Raises ``ValueError`` (or ``RecoveryError``) if a state received from
            a peer does not fit this group; called before anything of it is applied.
        max_state_bytes: The largest state a peer may send, asked before each copy.

    Raises:
        ImportError: if torchft is not installed.
        RuntimeError: if the lighthouse cannot be reached within ``connect_timeout``.
        ValueError: if ``DREAM_TRAINER_FT_SECRET`` is set but too short.
    """

    def __init__(self, params: FaultToleranceParameters, world: DistributedWorld,
                 state_dict: Callable[[], Any], load_state_dict: Callable[[Any], None],
                 check_state: Callable[[Any], None], max_state_bytes: Callable[[], int]) -> None:
        torchft = import_torchft()
        self.params = params
        self.device = world.device
        self._check_state = check_state
        self._store: dist.TCPStore | None = None
        secret = secret_from_env()
        bind, host = params.bind_address, advertised(params.bind_address)
        problem, port = None, 0
        if world.is_rank_zero:
            if is_wildcard(bind):
                logger.warning(wildcard_warning(f"replica group {params.replica_id}", bind))
            problem = _unreachable(params.lighthouse, params.connect_timeout)
            if problem is None:
                self._store = group_store(bind, params.connect_timeout)
                port = self._store.port
        if world.world_size > 1:
            shared: list[Any] = [problem, port]
            dist.broadcast_object_list(shared, src=0)
            problem, port = shared
        if problem is not None:
            raise RuntimeError(problem)
        def load_peer_state(state: Any) -> None:
            try:
                load_state_dict(state)
            except Exception as exc:
                raise RecoveryError(
                    f"replica group {params.replica_id} could not apply the state it copied "
                    f"from a live peer: {type(exc).__name__}: {exc}"
                ) from exc

        self.process_group = torchft.ProcessGroupNCCL(timeout=params.timeout) \
            if self.device.type == "cuda" else bound_gloo(torchft, host, params.timeout)
        self.transport = StateTransport(bind, host, params.timeout, secret, self._check,
                                        max_state_bytes)
        with manager_server_bound_to(torchft, bind):
            self.manager = torchft.Manager(
                pg=self.process_group, load_state_dict=load_peer_state, state_dict=state_dict,
                min_replica_size=params.min_replicas,
                # A synchronous quorum applies a peer's state before the step's forward pass,
                # so a recovering group takes part in the very step it recovered for.
                use_async_quorum=False,
                timeout=params.timeout, quorum_timeout=params.quorum_timeout,
                connect_timeout=params.connect_timeout,
                rank=world.rank, world_size=world.world_size,
                store_addr=host, store_port=port, lighthouse_addr=params.lighthouse,
                replica_id=f"replica_{params.replica_id}", hostname=host,
                checkpoint_transport=self.transport,
                max_retries=params.max_failed_commits,
            )

    def _check(self, received: Any, step: int) -> None:
        """Refuse a peer's state that is not a replica group's state for the quorum's step,
        at or past this group's, or that does not fit this group (``check_state``)."""
        counters = received.get("torchft") if isinstance(received, dict) else None
        if not (isinstance(received, dict) and received.keys() == {"user", "torchft"}
                and isinstance(received["user"], dict) and "default" in received["user"]
                and isinstance(counters, dict)
                and all(isinstance(counters.get(key), int)
                        for key in ("step", "batches_committed"))):
            raise RecoveryError("it is not a replica group's state ({'user': {'default': "
                                "...}, 'torchft': {'step': int, 'batches_committed': int}})")
        own = self.manager.current_step()
        if counters["step"] != step or step < own:
            raise RecoveryError(
                f"it claims step {counters['step']} where the quorum recovers to step {step}, "
                f"and this group has committed {own} steps: a peer's state must be of the "
                "quorum's step, at or past this group's")
        self._check_state(received["user"]["default"])

    # -- one step ---------------------------------------------------------------------------
    def start_step(self) -> None:
        """Form this step's quorum with the live groups; recover from a peer if behind.

        Raises:
            RuntimeError: if no quorum of ``min_replicas`` groups forms within
                ``quorum_timeout`` (or the lighthouse is gone).
            RecoveryError: if applying a peer's state failed after it passed
                ``check_state`` (a refused state is logged instead, and the step does not
                commit).
        """
        try:
            self.manager.start_quorum()
        except RecoveryError:
            raise
        except Exception as exc:
            raise RuntimeError(
                f"replica group {self.params.replica_id}: no quorum of at least "
                f"{self.params.min_replicas} replica group(s) formed at the lighthouse "
                f"{self.params.lighthouse} within quorum_timeout="
                f"{self.params.quorum_timeout.total_seconds():g}s: check that the lighthouse "
                "is running and that enough groups are up, or raise quorum_timeout "
                f"({type(exc).__name__}: {exc})"
            ) from exc
        error = self.manager.errored()
        if error is not None:
            # torchft keeps going with the step, which cannot commit: say why (a peer whose
            # state was refused is named here).
            logger.warning("replica group %d: this step will not commit: %s",
                           self.params.replica_id, error.original_exception)

    def reduce_gradients(self, parameters: Sequence[nn.Parameter], summed: bool) -> None:
        """Average (or add up) the gradients of ``parameters`` over the live groups."""
        reduce_gradients(self.manager, parameters, summed=summed,
                         bucket_bytes=int(self.params.bucket_cap_mb * 2**20), device=self.device)

    def sum_across_groups(self, tensor: torch.Tensor) -> None:
        """Add up ``tensor`` (a float count) over the live groups, in place."""
        from torch.distributed import ReduceOp

        self.manager.allreduce(tensor, reduce_op=ReduceOp.SUM).wait()

    def commit(self) -> bool:
        """Vote on this step: True when every rank of this group finished it without error
        and at least ``min_replicas`` groups took part; then the optimizer may step.

        Raises:
            RuntimeError: after ``max_failed_commits`` consecutive steps that did not commit.
        """
        try:
            return bool(self.manager.should_commit())
        except RuntimeError as exc:
            raise RuntimeError(
                f"replica group {self.params.replica_id}: {self.params.max_failed_commits} "
                "optimizer steps in a row failed to commit (a peer kept failing mid-step, or "
                f"fewer than min_replicas={self.params.min_replicas} groups were live): {exc}"
            ) from exc

    # -- state ------------------------------------------------------------------------------
    @property
    def committed_steps(self) -> int:
        """Optimizer steps committed by the groups so far (also those before a recovery)."""
        return int(self.manager.current_step())

    @property
    def participants(self) -> int:
        """Replica groups in the current quorum (0 before the first)."""
        return int(self.manager.num_participants())

    def state_dict(self) -> dict[str, int]:
        """The manager's counters, which a checkpoint keeps so that a full restart knows how
        far each group had got."""
        return {key: int(value) for key, value in self.manager.state_dict().items()}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.manager.load_state_dict(dict(state))

    def shutdown(self) -> None:
        """Stop the manager's servers and leave the cross-group process group."""
        self.manager.shutdown(wait=True)
        self.process_group.shutdown()
        self._store = None


def _unreachable(address: str, timeout: timedelta) -> str | None:
    """Why the lighthouse at ``address`` cannot be reached, or None when it answers."""
    from torchft.coordination import LighthouseClient

    try:
        LighthouseClient(address, connect_timeout=timeout)
    except Exception as exc:
        return (f"cannot reach the torchft lighthouse at {address} within connect_timeout="
                f"{timeout.total_seconds():g}s: start one with `dream-trainer lighthouse "
                "--min-replicas N` and set fault_tolerance_parameters.lighthouse to the "
                f"address it prints ({type(exc).__name__}: {exc})")
    return None
