"""``dream-trainer lighthouse``: the torchft lighthouse that replica groups form quorums at."""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from types import FrameType
from typing import Any

from dream_trainer.cli.arguments import positive_int
from dream_trainer.ft.listeners import is_wildcard, url_host, wildcard_warning

DEFAULT_BIND = "127.0.0.1:29510"
"""Where the lighthouse listens unless told otherwise: this host only."""


def add_parser(commands: Any) -> argparse.ArgumentParser:
    parser = commands.add_parser(
        "lighthouse", allow_abbrev=False,
        help="run the torchft lighthouse that fault-tolerant replica groups meet at",
        description="Serve torchft's lighthouse until interrupted (Ctrl-C or SIGTERM). Replica "
                    "groups of a FaultTolerantMixin trainer ask it for a quorum before every "
                    "optimizer step; it forms one from the live groups once at least "
                    "--min-replicas have joined. Prints the address to set as "
                    "fault_tolerance_parameters.lighthouse. Needs the [ft] extra (torchft).")
    parser.add_argument("--min-replicas", type=positive_int, required=True, metavar="N",
                        help="fewest replica groups in a quorum (the trainers' min_replicas)")
    parser.add_argument("--bind", default=DEFAULT_BIND, metavar="HOST:PORT",
                        help=f"address to listen on (default: {DEFAULT_BIND}, this host only; "
                             "give this host's address on the groups' network when they run "
                             "elsewhere; 0.0.0.0 or [::] listens on every interface, only on a "
                             "trusted network; port 0 picks a free one)")
    parser.add_argument("--join-timeout-ms", type=positive_int, default=None, metavar="MS",
                        help="how long a quorum waits for more groups once --min-replicas "
                             "have joined (default: torchft's, 60000)")
    parser.add_argument("--quorum-tick-ms", type=positive_int, default=None, metavar="MS",
                        help="how often a pending quorum is re-evaluated (default: torchft's, "
                             "100)")
    parser.add_argument("--heartbeat-timeout-ms", type=positive_int, default=None, metavar="MS",
                        help="silence after which a group counts as dead (default: torchft's, "
                             "5000)")
    parser.set_defaults(run=run, takes_overrides=False)
    return parser


def start(bind: str, min_replicas: int, join_timeout_ms: int | None = None,
          quorum_tick_ms: int | None = None,
          heartbeat_timeout_ms: int | None = None) -> tuple[Any, str]:
    """Serve a lighthouse on ``bind`` (``HOST:PORT``); return it and the address that replica
    groups reach it at. Warns on stderr when ``HOST`` is every interface.

    Raises:
        ImportError: if torchft is not installed.
        RuntimeError: torchft's, if it cannot listen on ``bind``.
    """
    from torchft.coordination import LighthouseServer

    host = bind.rsplit(":", 1)[0]
    if is_wildcard(host):
        print(f"warning: {wildcard_warning('the lighthouse', host)}; its unauthenticated "
              "HTTP API can end any replica group", file=sys.stderr, flush=True)
    server = LighthouseServer(bind=bind, min_replicas=min_replicas,
                              join_timeout_ms=join_timeout_ms, quorum_tick_ms=quorum_tick_ms,
                              heartbeat_timeout_ms=heartbeat_timeout_ms)
    # torchft names itself by this host's name, which need not resolve to the address it
    # listens on: a lighthouse on one address is reached at that address.
    address = server.address()
    if not is_wildcard(host):
        address = f"http://{url_host(host.strip('[]'))}:{address.rsplit(':', 1)[1]}"
    return server, address


def run(args: argparse.Namespace, overrides: list[str]) -> int:
    try:
        server, address = start(args.bind, args.min_replicas, args.join_timeout_ms,
                                args.quorum_tick_ms, args.heartbeat_timeout_ms)
    except ImportError:
        print("error: the lighthouse needs torchft: pip install 'dream-trainer[ft]'",
              file=sys.stderr)
        return 1
    except Exception as exc:
        print(f"error: cannot serve a lighthouse on {args.bind}: {exc}", file=sys.stderr)
        return 1
    stop = threading.Event()

    def request_stop(signum: int, frame: FrameType | None) -> None:
        stop.set()

    previous = {sig: signal.signal(sig, request_stop) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        print(f"lighthouse listening on {address} (min_replicas={args.min_replicas}); "
              "set fault_tolerance_parameters.lighthouse to this address; Ctrl-C stops it",
              flush=True)
        while not stop.wait(0.5):
            pass
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        server.shutdown()
    print("lighthouse stopped", flush=True)
    return 0
