"""Script: ``checkpoint_run.py``, SIGKILLed halfway through loading its checkpoint the first
time (while MARKER does not exist): DCP's reader reads and copies into the live tensors the
first half of its read plan, MARKER records how many items, then the process kills itself.

Usage: kill_during_load.py MARKER ROOT OUT [checkpoint_run.py options]
"""

from __future__ import annotations

import dataclasses
import os
import signal
import sys
from pathlib import Path
from typing import Any

from dream_trainer.checkpoint.trust import reader_class
from tests.scripts import checkpoint_run


def kill_halfway_through_reading(marker: Path) -> None:
    reader = reader_class()  # the class every checkpoint read goes through
    read_data = reader.read_data

    def halfway(self: Any, plan: Any, planner: Any) -> Any:
        if marker.exists():
            return read_data(self, plan, planner)
        half = len(plan.items) // 2
        read_data(self, dataclasses.replace(plan, items=plan.items[:half]), planner)
        marker.write_text(f"{half} of {len(plan.items)}")
        os.kill(os.getpid(), signal.SIGKILL)

    reader.read_data = halfway


if __name__ == "__main__":
    kill_halfway_through_reading(Path(sys.argv[1]))
    sys.argv = [sys.argv[0], *sys.argv[2:]]
    checkpoint_run.main()
