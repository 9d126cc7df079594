"""``DistributedWorld``: rank, device, process group and device mesh of one run."""

from __future__ import annotations

import itertools
import logging
import random
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from dream_trainer.configs.device import DeviceParameters
from dream_trainer.world import agree
from dream_trainer.world.dims import MeshAxis, ParallelDims
from dream_trainer.world.environment import LaunchEnvironment, set_flight_recorder_entries
from dream_trainer.world.launcher_watch import LauncherWatch
from dream_trainer.world.materialization import Materialization

logger = logging.getLogger(__name__)

# Numbers the process groups this process creates. torch names every default group "0" in the
# rendezvous store, and torchrun's store outlives a worker group, so a second group in the
# same process (a sweep, a second fit()) or in a restarted worker group (--max-restarts) would
# read stale addresses and fail or hang (pytorch#135712). The prefix names the restart attempt
# and the launch; every rank restarts and launches the same number of times.
_LAUNCH_COUNTER = itertools.count()


class DistributedWorld:
    """The topology of a run: who this process is, which device it drives, and the mesh.

    Construction reads the launcher environment and resolves the mesh degrees, so a mesh that
    does not fit the world size fails here, before any process group or collective exists.
    ``launch()`` creates the process group and mesh; ``shutdown()`` tears down what
    ``launch()`` created.

    Args:
        device_parameters: The configured mesh degrees, device and timeouts.
        env: The launcher environment; when omitted, the one activated by
            ``LaunchEnvironment.activate()``, else read from ``os.environ``.

    Raises:
        MeshMismatchError: if the degrees cannot multiply to the world size.
        ValueError: if ``device="cuda"`` or ``"mps"`` is asked for without such a device,
            or ``"mps"`` in a world of several processes.
    """

    def __init__(self, device_parameters: DeviceParameters,
                 env: LaunchEnvironment | None = None) -> None:
        self.env = env if env is not None else LaunchEnvironment.current()
        self.device_parameters = device_parameters
        self.dims = ParallelDims.resolve(device_parameters, self.env.world_size)
        self.device = pick_device(device_parameters.device, self.env.local_rank,
                                  self.env.world_size)
        self.mesh: DeviceMesh | None = None
        self.materialization = Materialization()
        """How setup creates model tensors: with values, unless a tool chose otherwise
        (``BaseTrainer.set_up(materialization=...)``)."""
        self.replica_group = 0
        """This run's index among the replica groups that train one model (fault tolerance)."""
        self.replica_groups = 1
        """How many replica groups train the model together; 1 without fault tolerance."""
        self._flat_meshes: dict[MeshAxis, DeviceMesh] = {}
        self._owns_process_group = False
        self._anomaly_before: bool | None = None
        self._launcher_watch = None if self.env.launcher_pid is None \
            else LauncherWatch(self.env.launcher_pid, self.env.rank)

    # -- identity ---------------------------------------------------------------------------
    @property
    def rank(self) -> int:
        return self.env.rank

    @property
    def local_rank(self) -> int:
        return self.env.local_rank

    @property
    def world_size(self) -> int:
        return self.env.world_size

    @property
    def is_rank_zero(self) -> bool:
        return self.env.rank == 0

    @property
    def backend(self) -> str:
        """The environment's backend if it names one; else gloo on the CPU, and nccl for CUDA
        tensors with gloo kept for CPU-side collectives."""
        if self.env.backend is not None:
            return self.env.backend
        return "cuda:nccl,cpu:gloo" if self.device.type == "cuda" else "gloo"

    @property
    def simulated(self) -> bool:
        """True when this process simulates one rank of the job on torch's "fake" backend
        (``dream-trainer plan``): collectives move no data, and the tool that chose it also
        chooses a ``materialization`` without values."""
        return self.env.backend == "fake"

    @property
    def is_launched(self) -> bool:
        return agree.is_launched()

    # -- mesh -------------------------------------------------------------------------------
    def get_mesh(self, axis: MeshAxis) -> DeviceMesh | None:
        """The sub-mesh of one axis (or flattened view), or None when that axis has size 1."""
        if axis in self._flat_meshes:
            return self._flat_meshes[axis]
        if self.mesh is None or axis.value not in (self.mesh.mesh_dim_names or ()):
            return None
        return self.mesh[axis.value]

    def launched_mesh(self, axis: MeshAxis) -> DeviceMesh:
        """``get_mesh(axis)`` for an axis the run has.

        Raises:
            RuntimeError: when the axis does not exist (yet): before launch, or size 1.
        """
        mesh = self.get_mesh(axis)
        if mesh is None:
            raise RuntimeError(f"the {axis} mesh axis does not exist: the run is not launched")
        return mesh

    def get_group(self, axis: MeshAxis) -> dist.ProcessGroup | None:
        """The process group of ``get_mesh(axis)``, or None when that axis has size 1."""
        return _group_of(self.get_mesh(axis))

    @property
    def dp_mesh(self) -> DeviceMesh | None:
        """The mesh over every data-parallel rank (replicas and shards), or None."""
        for axis in (MeshAxis.DP, MeshAxis.DP_SHARD, MeshAxis.DP_REPLICATE):
            mesh = self.get_mesh(axis)
            if mesh is not None:
                return mesh
        return None

    @property
    def dp_group(self) -> dist.ProcessGroup | None:
        """The process group of ``dp_mesh`` (every data-parallel rank), or None when there
        is one data-parallel rank."""
        return _group_of(self.dp_mesh)

    @property
    def batch_mesh(self) -> DeviceMesh | None:
        """The mesh over every rank that holds a different part of a batch's items: the
        data-parallel ranks, times the context-parallel ranks (each holding part of every
        sequence); metrics are gathered over it. None when there is one such rank."""
        return self.get_mesh(MeshAxis.DP_CP) if self.dims.cp > 1 else self.dp_mesh

    @property
    def fsdp_mesh(self) -> DeviceMesh | None:
        """The mesh FSDP2 shards over: dp_shard (dp_shard x cp with context parallelism), or
        (dp_replicate, that) for HSDP."""
        if self.mesh is None or self.dims.fsdp == 1:
            return None
        shard = MeshAxis.DP_SHARD_CP if self.dims.cp > 1 else MeshAxis.DP_SHARD
        if self.dims.dp_replicate > 1:
            return self.mesh[(MeshAxis.DP_REPLICATE.value, shard.value)]
        return self.get_mesh(shard)

    @property
    def expert_fsdp_mesh(self) -> DeviceMesh | None:
        """The mesh FSDP2 shards each rank's experts over under expert parallelism: efsdp,
        or (dp_replicate, efsdp) for HSDP; None without expert parallelism."""
        if self.mesh is None or self.dims.ep == 1:
            return None
        if self.dims.dp_replicate > 1:
            return self.mesh[(MeshAxis.DP_REPLICATE.value, MeshAxis.EFSDP.value)]
        return self.mesh[MeshAxis.EFSDP.value]

    @property
    def gradient_ranks(self) -> int:
        """How many ranks' gradients the reduction averages: the data-parallel ranks times
        the context-parallel ranks, each of which holds part of every sequence."""
        return self.dims.dp * self.dims.cp

    @property
    def dp_size(self) -> int:
        return self.dims.dp

    @property
    def dp_rank(self) -> int:
        """This rank's index among the data-parallel ranks: which slice of the data it reads."""
        mesh = self.dp_mesh
        return 0 if mesh is None else mesh.get_local_rank()

    @property
    def data_shards(self) -> int:
        """Into how many disjoint shares the training data is split: one per data-parallel
        rank of every replica group."""
        return self.dp_size * self.replica_groups

    @property
    def data_shard(self) -> int:
        """Which of the ``data_shards`` shares this rank reads."""
        return self.replica_group * self.dp_size + self.dp_rank

    def join_replica_groups(self, index: int, count: int) -> None:
        """Make this run replica group ``index`` of ``count`` groups of identical topology
        that train one model (``FaultTolerantMixin``): each reads its own share of the
        training data. Validation data stays split over this group's ranks only.

        Raises:
            ValueError: if ``index`` is not in ``range(count)``.
        """
        if not 0 <= index < count:
            raise ValueError(f"replica group {index} is outside range({count})")
        self.replica_group, self.replica_groups = index, count

    # -- lifecycle --------------------------------------------------------------------------
    def launch(self) -> None:
        """Create the process group (unless one exists) and the named device mesh.

        A process group that already exists is reused and left alone by ``shutdown()``.
        Without a launcher, a one-process group on an in-memory store is created, so that
        collectives and meshes behave the same in a plain ``python train.py``. With
        ``detect_anomaly``, autograd anomaly detection is on until ``shutdown()``. Under
        torchrun, this process ends by itself within about a second if torchrun dies
        (``LauncherWatch``), until ``shutdown()``.
        """
        if self._launcher_watch is not None:
            self._launcher_watch.start()  # first: a rendezvous may wait for a dead launcher
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        if self.device_parameters.detect_anomaly and self._anomaly_before is None:
            self._anomaly_before = torch.is_anomaly_enabled()
            torch.autograd.set_detect_anomaly(True)
        if not agree.is_launched():
            if self.device_parameters.flight_recorder_entries is not None:
                set_flight_recorder_entries(self.device_parameters.flight_recorder_entries)
            timeout = self.device_parameters.init_timeout
            if self.simulated:
                # No store: torch's fake backend makes its own, and no peer will ever join.
                dist.init_process_group("fake", rank=self.rank, world_size=self.world_size,
                                        timeout=timeout)
            elif self.env.launched:
                store, rank, world_size = next(
                    dist.rendezvous("env://", self.rank, self.world_size, timeout=timeout))
                store.set_timeout(timeout)
                prefix = (f"dream_trainer/attempt_{self.env.restart_count}"
                          f"/launch_{next(_LAUNCH_COUNTER)}")
                dist.init_process_group(self.backend, store=dist.PrefixStore(prefix, store),
                                        rank=rank, world_size=world_size, timeout=timeout)
            else:
                dist.init_process_group(self.backend, store=dist.HashStore(), rank=0,
                                        world_size=1, timeout=timeout)
            self._owns_process_group = True
        elif dist.get_world_size() != self.world_size:
            raise RuntimeError(
                f"an existing process group has {dist.get_world_size()} ranks but the launcher "
                f"environment says {self.world_size}"
            )
        self._build_mesh()

    def _build_mesh(self) -> None:
        axes = self.dims.mesh_axes()
        if not axes:
            return
        self.mesh = init_device_mesh(
            self.device.type,
            tuple(size for _, size in axes),
            mesh_dim_names=tuple(axis.value for axis, _ in axes),
        )
        if self.dims.ep > 1:
            # Built from efsdp and the part of ep it lends (dims.dp_shard_axes), dp_shard is
            # their flattened view; ep borrows every cp rank besides that part.
            if self.dims.dp_shard > 1:
                self._flatten(MeshAxis.DP_SHARD, (MeshAxis.DP_SHARD,))
            if self.dims.cp > 1:
                self._flatten(MeshAxis.EP, (MeshAxis.DP_SHARD_IN_EP, MeshAxis.CP))
        if self.dims.dp_replicate > 1 and self.dims.dp_shard > 1:
            self._flatten(MeshAxis.DP, (MeshAxis.DP_REPLICATE, MeshAxis.DP_SHARD))
        if self.dims.cp > 1:
            # Registered on the root mesh even when dp_shard is 1 (then it is cp itself), so
            # that HSDP can slice (dp_replicate, dp_shard_cp).
            self._flatten(MeshAxis.DP_SHARD_CP, (MeshAxis.DP_SHARD, MeshAxis.CP))
            self._flatten(MeshAxis.DP_CP, (MeshAxis.DP_REPLICATE, MeshAxis.DP_SHARD, MeshAxis.CP))
        if self.dims.dp_shard > 1 and self.dims.tp > 1:
            # Parameters and gradients of FSDP2 x TP are sharded over both axes: with a
            # flattened mesh registered, DTensor gathers and reduces them (the gradient norm,
            # full_tensor()) in one collective instead of one per axis (and stops warning).
            self._flatten(MeshAxis.DP_SHARD_TP, (MeshAxis.DP_SHARD, MeshAxis.TP))

    def _flatten(self, view: MeshAxis, axes: tuple[MeshAxis, ...]) -> None:
        """Register ``view``, the flattened mesh of those of ``axes`` that exist (dp_shard
        standing for the physical axes it is built from)."""
        assert self.mesh is not None
        physical = []
        for axis in axes:
            parts = self.dims.dp_shard_axes() if axis == MeshAxis.DP_SHARD else [(axis, 0)]
            physical += [part.value for part, _ in parts]
        present = tuple(name for name in physical if name in self.mesh.mesh_dim_names)
        self._flat_meshes[view] = self.mesh[present]._flatten(view.value)

    def seed(self, seed: int | None) -> None:
        """Seed python, numpy and torch (every device) with the same seed on every rank.

        The same seed everywhere makes every rank build identical initial weights, which
        data parallelism requires. ``None`` leaves the generators as they are.
        """
        if seed is None:
            return
        random.seed(seed)
        torch.manual_seed(seed)
        try:
            import numpy as np
        except ImportError:
            return
        np.random.seed(seed % 2**32)

    def set_timeout(self, timeout: timedelta) -> None:
        """Apply a new collective timeout to the default group and every mesh group."""
        if not self.is_launched:
            return
        from torch.distributed.distributed_c10d import _set_pg_timeout

        groups = {dist.group.WORLD}
        if self.mesh is not None:
            groups.update(self.mesh.get_all_groups())
        groups.update(mesh.get_group() for mesh in self._flat_meshes.values())
        for group in groups:
            _set_pg_timeout(timeout, group)

    def new_group(self, backend: str = "gloo") -> dist.ProcessGroup:
        """A new process group over every rank, for traffic kept apart from training's
        (checkpoint I/O, agreements between ranks). A simulated world's is fake too.

        Every rank must call it, in the same order, after ``launch()``.
        """
        group = dist.new_group(backend="fake" if self.simulated else backend)
        assert group is not None  # every rank is a member
        return group

    def barrier(self) -> None:
        agree.barrier()

    def shutdown(self, graceful: bool = True) -> None:
        """Destroy the process group created by ``launch()``; restore anomaly detection; stop
        watching the launcher.

        Args:
            graceful: When True, all ranks meet at a barrier first (an abrupt gloo teardown
                while a peer is still communicating can abort the process), then let the
                backend's threads settle. After a failure the peers may never arrive, so
                both are skipped.
        """
        self.mesh = None
        self.materialization = Materialization()  # a tool's choice lasts one set-up run
        self._flat_meshes.clear()
        if self._anomaly_before is not None:
            torch.autograd.set_detect_anomaly(self._anomaly_before)
            self._anomaly_before = None
        try:
            if not (self._owns_process_group and agree.is_launched()):
                return
            try:
                if graceful:
                    self.barrier()
                    _let_backend_threads_settle()
            finally:
                dist.destroy_process_group()
                self._owns_process_group = False
        finally:
            # Last: a launcher that dies while the group is torn down still ends the process.
            if self._launcher_watch is not None:
                self._launcher_watch.stop()

    def __repr__(self) -> str:
        return (f"DistributedWorld(rank={self.rank}, world_size={self.world_size}, "
                f"device={self.device}, dims={self.dims})")


# Measured: a 2-rank script ending in a DTensor all-gather, a barrier and the group's
# destruction aborted in 2 of 30 runs on a loaded 2-core machine without this pause, 0 of 80
# with it.
_SETTLE_SECONDS = 0.05


def _let_backend_threads_settle() -> None:
    """Sleep briefly, the interpreter lock released, before the process may exit.

    A gloo group's worker threads outlive ``destroy_process_group`` once functional
    collectives have used the group, and each releases a finished collective after waking
    its caller. Releasing one whose tensors Python has seen takes the interpreter lock; if
    the interpreter is already exiting, that thread is unwound inside a destructor and the
    process aborts ("terminate called without an active exception") after its work is done.
    """
    time.sleep(_SETTLE_SECONDS)


def mps_available() -> bool:
    """Whether torch reports an MPS device (Apple silicon, a torch built with MPS)."""
    return torch.backends.mps.is_available()


def pick_device(choice: str, local_rank: int, world_size: int) -> torch.device:
    """The device of ``DeviceParameters.device`` on this machine.

    ``"auto"`` is CUDA device ``local_rank % device_count`` when CUDA is available, else MPS
    when torch reports it and the world has one process, else the CPU.

    Raises:
        ValueError: naming the fix, if ``"cuda"`` or ``"mps"`` is not available, or
            ``"mps"`` is asked for in a world of several processes.
    """
    if choice == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' but no CUDA device is available: use 'auto' or 'cpu'")
    if choice == "mps":
        if not mps_available():
            raise ValueError("device='mps' but torch reports no MPS device "
                             "(torch.backends.mps.is_available() is False: it needs Apple "
                             "silicon and a torch built with MPS): use 'auto' or 'cpu'")
        if world_size > 1:
            raise ValueError(_MPS_ONE_PROCESS.format(world_size=world_size))
        return torch.device("mps")
    if choice != "cpu" and torch.cuda.is_available():
        return torch.device("cuda", local_rank % torch.cuda.device_count())
    if choice == "auto" and world_size == 1 and mps_available():
        return torch.device("mps")
    return torch.device("cpu")


# gloo, the one backend torch has for processes without CUDA, moves CPU (and CUDA) tensors
# only, so ranks on MPS could not reduce gradients; a Mac has one MPS device anyway.
_MPS_ONE_PROCESS = ("device='mps' runs one process, but the world has {world_size}: gloo "
                    "cannot move MPS tensors between processes. Run `python train.py` "
                    "without torchrun, or use device='cpu' (or 'auto', which picks the CPU "
                    "for several processes)")


def _group_of(mesh: DeviceMesh | None) -> dist.ProcessGroup | None:
    return None if mesh is None else mesh.get_group()
