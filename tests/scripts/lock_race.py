"""Script: runs that take over one dead lock at the same moment, trial after trial.

Usage: lock_race.py ROOT TRIALS CONTENDERS [--no-os-locks]

Each trial directory starts with a lock whose holder is dead. The contenders, forked once,
wait at a barrier, all call ``RunLock.acquire()`` on the trial's directory, and meet again
(so a winner still holds the lock while every other contender tries); each winner checks
that the file names it, and once all have, releases. Prints one JSON line: the number of
winners of each trial, how many winners found the file naming another process, and the
losers' errors (their text up to the directory). ``--no-os-locks`` makes ``flock`` fail as
on a filesystem without locks, so that the record and its takeover marker decide alone.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import logging
import multiprocessing
import os
import subprocess
import sys
from collections import Counter
from multiprocessing.synchronize import Barrier, Lock
from pathlib import Path
from typing import Any

from dream_trainer.checkpoint import CheckpointError
from dream_trainer.checkpoint import lock as run_lock


def no_os_locks(descriptor: int, operation: int) -> None:
    raise OSError(errno.ENOLCK, "No locks available")


def contend(root: Path, trials: int, barrier: Barrier, counter: Lock, winners: Any,
            impostors: Any, errors: Any, os_locks: bool) -> None:
    if not os_locks:
        run_lock.fcntl.flock = no_os_locks  # type: ignore[attr-defined]
    try:
        for trial in range(trials):
            lock = run_lock.RunLock(root / str(trial))
            barrier.wait()
            try:
                lock.acquire()
            except CheckpointError as exc:
                errors.put(str(exc).split(" on ")[0])
            barrier.wait()
            if lock.held:
                named = json.loads(lock.path.read_text())["pid"]
                with counter:
                    winners[trial] += 1
                    impostors.value += named != os.getpid()
            barrier.wait()  # every winner has read the file before any releases it
            lock.release()
    except Exception as exc:  # reported, and the barrier's timeout frees the others
        errors.put(f"crashed: {type(exc).__name__}: {exc}")
    finally:
        errors.put(None)


def main() -> None:
    root, trials, contenders = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    os_locks = "--no-os-locks" not in sys.argv
    logging.getLogger("dream_trainer").setLevel(logging.ERROR)  # a takeover warning per trial
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    record = dataclasses.replace(run_lock.LockHolder.this_process(), pid=int(dead.stdout),
                                 launcher_pid=1)
    for trial in range(trials):
        (root / str(trial)).mkdir(parents=True)
        (root / str(trial) / run_lock.LOCK).write_text(json.dumps(dataclasses.asdict(record)))
    context = multiprocessing.get_context("fork")
    barrier = context.Barrier(contenders, timeout=60)
    counter = context.Lock()
    winners, impostors = context.Array("i", trials), context.Value("i", 0)
    errors = context.Queue()
    processes = [context.Process(target=contend, args=(root, trials, barrier, counter, winners,
                                                        impostors, errors, os_locks))
                 for _ in range(contenders)]
    for process in processes:
        process.start()
    losers: Counter[str] = Counter()
    finished = 0
    while finished < contenders:
        error = errors.get(timeout=300)
        if error is None:
            finished += 1
        else:
            losers[error] += 1
    for process in processes:
        process.join()
    left = sorted(str(path.relative_to(root)) for path in root.rglob(".lock*"))
    print(json.dumps({"winners": list(winners), "impostors": impostors.value,
                      "losers": losers, "left": left,
                      "exit_codes": [process.exitcode for process in processes]}))


if __name__ == "__main__":
    main()
