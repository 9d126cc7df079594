"""Where the sockets of fault tolerance listen: only on the configured address.

A replica group opens four listeners (the torchft manager on its rank 0, the group's store on
rank 0, a state server on every rank, and the gloo process group that joins it to the other
groups); the lighthouse opens one. torchft binds the manager to every interface and gloo
binds the address the host name resolves to, so both are steered here to the address that
``FaultToleranceParameters.bind_address`` names.
"""

from __future__ import annotations

import contextlib
import ipaddress
import socket
from collections.abc import Iterator
from datetime import timedelta
from types import ModuleType
from typing import Any

import torch

SECURITY_DOCS = "docs/reliability.md#security"


def is_wildcard(host: str) -> bool:
    """Whether listening on ``host`` means every interface (``0.0.0.0``, ``::``, empty)."""
    host = host.strip("[]")
    if not host:
        return True
    try:
        return ipaddress.ip_address(host).is_unspecified
    except ValueError:
        return False


def wildcard_warning(what: str, host: str) -> str:
    """The warning for ``what`` listening on the wildcard ``host``."""
    return (f"{what} listens on every network interface ({host or 'empty host'}): any host "
            "that can reach it can join the replica groups, stop them, or (without "
            "DREAM_TRAINER_FT_SECRET) copy the training state; use it only on a network you "
            f"trust, see {SECURITY_DOCS}")


def url_host(host: str) -> str:
    """``host`` as it goes in a URL or a ``HOST:PORT`` (an IPv6 address in brackets)."""
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def family_of(host: str) -> socket.AddressFamily:
    """The address family of an IP address (IPv6 for ``::`` too)."""
    return socket.AF_INET6 if ":" in host else socket.AF_INET


def advertised(bind: str) -> str:
    """The host that peers are told to connect to: ``bind``, or this host's name when
    ``bind`` is a wildcard (peers cannot connect to ``0.0.0.0``)."""
    return socket.gethostname() if is_wildcard(bind) else bind


def listening_socket(host: str) -> socket.socket:
    """A TCP socket listening on ``host`` at a port the system picks."""
    sock = socket.socket(family_of(host), socket.SOCK_STREAM)
    try:
        sock.bind((host, 0))
        sock.listen()
    except OSError:
        sock.close()
        raise
    return sock


def group_store(bind: str, timeout: timedelta) -> Any:
    """The replica group's ``TCPStore``, listening on ``bind`` only (by default a store
    listens on every interface, whatever host it is given)."""
    import torch.distributed as dist

    sock = listening_socket(bind)
    port = sock.getsockname()[1]
    # wait_for_workers=False: the group's other ranks connect when they build their manager,
    # after rank 0 has shared the port. The store owns the socket from here on.
    return dist.TCPStore(advertised(bind), port, is_master=True, wait_for_workers=False,
                         timeout=timeout, master_listen_fd=sock.detach())


@contextlib.contextmanager
def manager_server_bound_to(torchft: ModuleType, bind: str) -> Iterator[None]:
    """While open, a torchft ``Manager`` built in this thread serves its manager on
    ``bind`` instead of every interface.

    torchft 0.2.0 builds its ``ManagerServer`` inside ``Manager.__init__`` with a hard-coded
    ``bind="[::]:PORT"`` and no way to pass an address, so the module's ``ManagerServer`` is
    replaced, for the constructor's call only, by one that keeps the port and swaps the host.
    """
    module = torchft.manager
    original = module.ManagerServer

    def bound_server(**kwargs: Any) -> Any:
        port = kwargs["bind"].rsplit(":", 1)[1]
        return original(**{**kwargs, "bind": f"{url_host(bind)}:{port}"})

    module.ManagerServer = bound_server
    try:
        yield
    finally:
        module.ManagerServer = original


def bound_gloo(torchft: ModuleType, host: str, timeout: timedelta) -> Any:
    """torchft's reconfigurable gloo process group, listening on ``host``, the address its
    peers connect to (gloo otherwise listens on the address the host name resolves to, or
    on ``GLOO_SOCKET_IFNAME``'s)."""
    from torch.distributed import ProcessGroup, ProcessGroupGloo

    class BoundGloo(torchft.ProcessGroupGloo):  # type: ignore[misc,name-defined]
        def _create_pg(self, store: Any, rank: int, world_size: int) -> ProcessGroup:
            options = ProcessGroupGloo._Options()
            options._timeout = self._timeout
            options._devices = [ProcessGroupGloo.create_device(hostname=host)]
            backend = ProcessGroupGloo(store, rank, world_size, options)
            backend._set_sequence_number_for_group()
            group = ProcessGroup(store, rank, world_size)
            group._set_default_backend(ProcessGroup.BackendType.GLOO)
            for device in ("cpu", "cuda") if torch.cuda.is_available() else ("cpu",):
                group._register_backend(torch.device(device), ProcessGroup.BackendType.GLOO,
                                        backend)
            return group

    return BoundGloo(timeout=timeout)
