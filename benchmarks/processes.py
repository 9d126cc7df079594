"""What the benchmarks that run child processes share: their environment and RSS readings.

Standard library only: the Lightning runner imports it from an environment without
dream_trainer.
"""

from __future__ import annotations

import os
import resource
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]


def child_env() -> dict[str, str]:
    """This environment with the repository importable and one thread per process."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def current_rss_bytes() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB
