"""Launching real multi-process runs for integration tests."""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


# Ports are drawn below Linux's ephemeral range (32768-60999): a port the OS chose for bind(0)
# is free only until some process's outgoing connection (gloo opens many) takes it as its
# local port, before the launcher that was given it binds it.
_ALL_PORTS = range(20_000, 32_000)


def _worker_ports(ports: range) -> range:
    """The share of ``ports`` of this pytest-xdist worker (all of them without xdist): two
    workers never draw the same port, whatever each has checked as free."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    index = int(worker.removeprefix("gw"))
    share = len(ports) // count
    return range(ports.start + index * share, ports.start + (index + 1) * share)


_PORTS = _worker_ports(_ALL_PORTS)
_given: set[int] = set()
# Its own generator: a test that seeds `random` must not make two suites draw the same ports.
_draw = random.Random()


def free_port() -> int:
    """A TCP port that is free now, outside the ephemeral range and never given out before
    by this process (two launches of one test must not be handed the same port)."""
    while True:
        port = _draw.choice(_PORTS)
        if port in _given:
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
        _given.add(port)
        return port


def child_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment for a child process: one thread, no launcher variables inherited."""
    env = {k: v for k, v in os.environ.items()
           if k not in {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
                        "MASTER_ADDR", "MASTER_PORT"}}
    env.update({"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
                "PYTHONPATH": os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])})
    env.update(extra or {})
    return env


def torchrun(script: str | Path, args: Sequence[str] = (), nproc: int = 2,
             timeout: float = 240, env: Mapping[str, str] | None = None,
             cwd: str | Path | None = None) -> subprocess.CompletedProcess[str]:
    """Run ``script`` on ``nproc`` CPU ranks on 127.0.0.1 as torchrun runs its workers, without
    torchrun's agent process; capture their combined output.

    What the ranks see is what torchrun gives them: its environment variables, and a store
    hosted by the launcher (this process) rather than by rank 0, so every rendezvous a script
    makes is a client of it. What the caller sees is what torchrun returns: 0 when every rank
    exits 0, else 1 once the first rank to fail has failed and the others, sent SIGTERM, have
    exited (SIGKILL after 30 s). The agent is left out because it cost each launch about 5 s
    (it imports torch and runs a rendezvous before starting a rank) and the suite launches
    over a hundred times; tests of torchrun's own behaviour (restarts, several agents) run the
    real one.

    Raises:
        subprocess.TimeoutExpired: after ``timeout`` seconds, the ranks killed.
    """
    from torch.distributed import TCPStore

    port = free_port()
    store = TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    command = [sys.executable, str(script), *args]
    run_id = f"dream-trainer-test-{port}"
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        ranks = [subprocess.Popen(command, env=child_env({**_worker_env(rank, nproc, port,
                                                                         run_id), **(env or {})}),
                                  cwd=cwd, stdout=out, stderr=err, text=True,
                                  start_new_session=True)
                 for rank in range(nproc)]
        try:
            returncode = _supervise(ranks, timeout, command)
        finally:
            for rank in ranks:
                _kill_session(rank)
            del store
        out.seek(0)
        err.seek(0)
        return subprocess.CompletedProcess(command, returncode, out.read(), err.read())


def _worker_env(rank: int, nproc: int, port: int, run_id: str | None) -> dict[str, str]:
    """The variables torchrun sets for rank ``rank`` of one node of ``nproc``; with a
    ``run_id`` also its elastic ones, which say that the launcher hosts the store (without
    one, rank 0 hosts it)."""
    variables = {"RANK": str(rank), "LOCAL_RANK": str(rank), "GROUP_RANK": "0",
                 "ROLE_RANK": str(rank), "ROLE_NAME": "default", "WORLD_SIZE": str(nproc),
                 "LOCAL_WORLD_SIZE": str(nproc), "GROUP_WORLD_SIZE": "1",
                 "ROLE_WORLD_SIZE": str(nproc), "MASTER_ADDR": "127.0.0.1",
                 "MASTER_PORT": str(port)}
    if run_id is not None:
        variables |= {"TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_MAX_RESTARTS": "0",
                      "TORCHELASTIC_RUN_ID": run_id, "TORCHELASTIC_USE_AGENT_STORE": "True"}
    return variables


def _supervise(ranks: Sequence[subprocess.Popen[str]], timeout: float,
               command: Sequence[str]) -> int:
    """Wait for ``ranks`` as torchrun's agent does: 0 when all exit 0; on the first failure,
    SIGTERM the rest, give them 30 s, SIGKILL them, and return 1."""
    deadline = time.monotonic() + timeout
    while True:
        codes = [rank.poll() for rank in ranks]
        if any(code not in (None, 0) for code in codes):
            break
        if all(code == 0 for code in codes):
            return 0
        if time.monotonic() > deadline:
            raise subprocess.TimeoutExpired(list(command), timeout)
        time.sleep(0.05)
    for rank in ranks:
        if rank.poll() is None:
            rank.terminate()
    grace = time.monotonic() + 30
    for rank in ranks:
        try:
            rank.wait(timeout=max(0.0, grace - time.monotonic()))
        except subprocess.TimeoutExpired:
            _kill_session(rank)
    return 1


def _kill_session(rank: subprocess.Popen[str]) -> None:
    """SIGKILL ``rank`` and the rest of the session it leads (its data-loader workers and
    other children) if it is still running, then reap it. Until it is reaped its pid is not
    reused, so the signal reaches no other process."""
    if rank.poll() is None:
        try:
            os.killpg(rank.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    rank.wait()


def run_script(script: str | Path, nproc: int, *args: str | Path,
               timeout: float = 240) -> subprocess.CompletedProcess[str]:
    """Run ``script`` with ``args`` as one plain process (``nproc=1``, no launcher) or under
    torchrun with ``nproc`` ranks; capture its output."""
    arguments = [str(arg) for arg in args]
    if nproc == 1:
        return subprocess.run([sys.executable, str(script), *arguments], env=child_env(),
                              cwd=REPO, capture_output=True, text=True, timeout=timeout)
    return torchrun(script, arguments, nproc=nproc, timeout=timeout)


def torchrun_nodes(script: str | Path, args: Sequence[str] = (), nnodes: int = 2,
                   timeout: float = 240) -> list[subprocess.CompletedProcess[str]]:
    """Start ``nnodes`` torchrun agents, one process each, that meet through a c10d
    rendezvous on 127.0.0.1, as separate machines would; wait for all of them."""
    endpoint = f"127.0.0.1:{free_port()}"
    command = [sys.executable, "-m", "torch.distributed.run", f"--nnodes={nnodes}",
               "--nproc_per_node=1", "--rdzv_backend=c10d", f"--rdzv_endpoint={endpoint}",
               "--rdzv_id=dream-trainer-test", str(script), *args]
    agents = [subprocess.Popen(command, env=child_env(), stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True) for _ in range(nnodes)]
    results = []
    try:
        for agent in agents:
            stdout, stderr = agent.communicate(timeout=timeout)
            results.append(subprocess.CompletedProcess(command, agent.returncode, stdout,
                                                       stderr))
    finally:
        for agent in agents:
            agent.kill()
    return results


def spawn_ranks(script: str | Path, args: Sequence[str] = (), nproc: int = 2,
                env: Mapping[str, str] | None = None) -> list[subprocess.Popen[str]]:
    """Start ``nproc`` processes with torchrun's variables set by hand (no agent to kill
    the survivors), so a test sees how each rank exits on its own."""
    port = free_port()
    procs = []
    for rank in range(nproc):
        rank_env = child_env({**_worker_env(rank, nproc, port, None), **(env or {})})
        procs.append(subprocess.Popen([sys.executable, str(script), *args], env=rank_env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      text=True))
    return procs


def outputs_of(procs: Sequence[subprocess.Popen[str]], timeout: float) -> list[str]:
    """Each process's combined output once it has exited (``timeout`` seconds each); any
    still running afterwards (a failed wait) is killed, so no test leaves ranks behind."""
    outputs = []
    try:
        for proc in procs:
            outputs.append(proc.communicate(timeout=timeout)[0])
    finally:
        for proc in procs:
            proc.kill()
    return outputs


def init_results_group(name: str) -> None:
    """In a torchrun script, create a gloo group after the trainers' own groups are gone.

    A bare ``init_process_group()`` would reuse the store keys of the trainers' earlier
    groups; the ``name`` prefix keeps this one apart.
    """
    import torch.distributed as dist

    store, rank, world_size = next(dist.rendezvous("env://"))
    dist.init_process_group("gloo", store=dist.PrefixStore(name, store), rank=rank,
                            world_size=world_size)


def save_on_rank_zero(result: object, out: str | Path, name: str) -> None:
    """Save ``result`` from rank 0 after the trainers' groups are gone (or in a plain run)."""
    import torch
    import torch.distributed as dist

    if "RANK" not in os.environ:
        torch.save(result, out)
        return
    init_results_group(name)
    if dist.get_rank() == 0:
        torch.save(result, out)
    dist.barrier()
    dist.destroy_process_group()


def check(result: subprocess.CompletedProcess[str]) -> subprocess.CompletedProcess[str]:
    """Fail with the child's output when it exited non-zero."""
    if result.returncode != 0:
        raise AssertionError(f"exit code {result.returncode}\n--- stdout\n{result.stdout}"
                             f"\n--- stderr\n{result.stderr}")
    return result
