"""Replica groups that survive the loss of one of them: where the lighthouse is, who this
group is, and how long to wait for the others (torchft)."""

from __future__ import annotations

import ipaddress
import math
from datetime import timedelta

from pydantic import NonNegativeInt, PositiveInt, model_validator

from dream_trainer.configs.base import ConfigModel


class FaultToleranceParameters(ConfigModel):
    """One replica group's place among the groups that train one model together.

    Every group is its own launch (its own ``torchrun``) with the same config except
    ``replica_id``; the groups find each other through the lighthouse
    (``dream-trainer lighthouse``), average their gradients and commit each optimizer step
    together. A group that fails is left out until it is started again and has copied the
    live state from a peer.
    """

    lighthouse: str = "http://127.0.0.1:29510"
    """Address of the torchft lighthouse, ``http://HOST:PORT`` (printed by
    ``dream-trainer lighthouse``; 29510 is its default port)."""
    bind_address: str = "127.0.0.1"
    """The IP address every listener of this group binds to (its manager, store, state
    server and cross-group gloo) and that peers are told to connect to. The default keeps
    them on this host; give this host's address on the network the groups share when they
    run on several hosts (it differs per host). ``0.0.0.0`` or ``::`` listens on every
    interface (peers are then given the host name), with a warning: only on a trusted
    network."""
    replica_id: NonNegativeInt = 0
    """This group's index, ``0 <= replica_id < replica_groups``: which share of the training
    data it reads. A group that is started again keeps its index."""
    replica_groups: PositiveInt = 1
    """How many replica groups the job has when all are live. The training data is split into
    ``replica_groups x`` (data-parallel ranks per group) disjoint shares; a group that is down
    leaves its share unread until it is back."""
    min_replicas: PositiveInt = 1
    """Fewest live groups that may commit an optimizer step. Start the lighthouse with the
    same ``--min-replicas``, so that a quorum of fewer groups is never formed."""
    timeout: timedelta = timedelta(seconds=60)
    """Limit on each collective across the groups, the vote that commits a step, and the copy
    of the state a recovering group fetches from a peer."""
    quorum_timeout: timedelta = timedelta(seconds=120)
    """How long a step waits for a quorum of at least ``min_replicas`` groups (longer than a
    group takes to restart, or training ends with an error instead of waiting)."""
    connect_timeout: timedelta = timedelta(seconds=30)
    """How long to try to reach the lighthouse and the peers' servers before giving up."""
    max_failed_commits: PositiveInt | None = 10
    """Consecutive optimizer steps that may fail to commit (a peer failed mid-step) before
    ``fit()`` raises; ``None`` retries forever."""
    bucket_cap_mb: float = 25.0
    """Gradients are averaged across the groups in buckets of at most this many MiB."""

    @model_validator(mode="after")
    def _check(self) -> FaultToleranceParameters:
        if self.replica_id >= self.replica_groups:
            raise ValueError(
                f"replica_id={self.replica_id} is not below replica_groups="
                f"{self.replica_groups}: number the groups 0 to {self.replica_groups - 1}, or "
                "raise replica_groups to the number of groups"
            )
        if self.min_replicas > self.replica_groups:
            raise ValueError(
                f"min_replicas={self.min_replicas} exceeds replica_groups="
                f"{self.replica_groups}: no step could ever commit; lower min_replicas"
            )
        for name in ("timeout", "quorum_timeout", "connect_timeout"):
            if getattr(self, name) <= timedelta(0):
                raise ValueError(f"{name} must be a positive duration, got {getattr(self, name)}")
        if not (math.isfinite(self.bucket_cap_mb) and self.bucket_cap_mb > 0):
            raise ValueError(
                f"bucket_cap_mb={self.bucket_cap_mb} is not a positive, finite size: give the "
                "largest gradient bucket in MiB (25 is a good start)")
        try:
            ipaddress.ip_address(self.bind_address)
        except ValueError:
            raise ValueError(
                f"bind_address={self.bind_address!r} is not an IP address: give the address "
                "of the interface to listen on, 127.0.0.1 (this host only) or this host's "
                "address on the groups' network, without brackets or port") from None
        if not self.lighthouse.startswith(("http://", "https://")):
            raise ValueError(
                f"lighthouse={self.lighthouse!r} is not an address: give it as "
                "http://HOST:PORT, as `dream-trainer lighthouse` prints it"
            )
        return self
