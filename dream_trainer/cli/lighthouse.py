"""``dream-trainer lighthouse``: the torchft lighthouse that replica groups form quorums at."""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from types import FrameType
from typing import Any

from dream_trainer.cli.arguments import positive_int


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
    parser.add_argument("--bind", default="[::]:29510", metavar="HOST:PORT",
                        help="address to listen on (default: [::]:29510; port 0 picks a free "
                             "one)")
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


def run(args: argparse.Namespace, overrides: list[str]) -> int:
    try:
        from torchft.coordination import LighthouseServer
    except ImportError:
        print("error: the lighthouse needs torchft: pip install 'dream-trainer[ft]'",
              file=sys.stderr)
        return 1
    try:
        server = LighthouseServer(bind=args.bind, min_replicas=args.min_replicas,
                                  join_timeout_ms=args.join_timeout_ms,
                                  quorum_tick_ms=args.quorum_tick_ms,
                                  heartbeat_timeout_ms=args.heartbeat_timeout_ms)
    except Exception as exc:
        print(f"error: cannot serve a lighthouse on {args.bind}: {exc}", file=sys.stderr)
        return 1
    stop = threading.Event()

    def request_stop(signum: int, frame: FrameType | None) -> None:
        stop.set()

    previous = {sig: signal.signal(sig, request_stop) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        print(f"lighthouse listening on {server.address()} (min_replicas={args.min_replicas}); "
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
