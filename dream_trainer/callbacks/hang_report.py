"""What each rank was doing when a run hung, and the verdict drawn from all of them.

When ``HangWatchdog`` ends a rank it writes ``hang_rank<R>.json``: the rank's step, the frames
of its main thread, its process groups (with the mesh axis each serves) and its flight
recorder's collectives (sequence number, operation, sizes, whether finished). ``verdict``
reads every rank's file and says which ranks are behind, the first collective they never
entered (by process group, mesh axis and sequence number) and the frame each is in; where
the backend recorded no collectives, it judges from the stacks alone and says so.
``report_once`` has one rank print it before any ended rank exits; ``dream-trainer diagnose
DIR`` prints it again later, after checking every record against the format written here.
"""

from __future__ import annotations

import errno
import functools
import json
import math
import os
import pickle
import stat
import sys
import sysconfig
import threading
import time
import traceback
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Annotated, Any

import torch
import torch.distributed as dist
from pydantic import Field, FiniteFloat, TypeAdapter, ValidationError
from typing_extensions import TypedDict

from dream_trainer.callbacks.hang_files import write_file
from dream_trainer.utils.bounded import read_bounded
from dream_trainer.utils.text import printable
from dream_trainer.world.agree import is_launched

RECORD = "hang_rank{rank}.json"
EMITTED = "hang_verdict.json"
"""Names the records the verdict printed during the hang covered (see ``report_once``)."""
MAX_WORLD_SIZE = 1 << 20
"""The most ranks a record may claim: far above any run, far below what exhausts memory."""
MAX_RECORD_BYTES = 64 * 2**20
"""The largest record read: a flight recorder of 100,000 collectives (50 times torch's default
buffer) writes about 20 MB, and checking 64 MiB takes seconds and under 1 GiB."""
_POLL = 0.1
_LIBRARIES = tuple(str(Path(p).resolve()) for p in {
    sysconfig.get_paths()["stdlib"], sysconfig.get_paths()["purelib"],
    sysconfig.get_paths()["platlib"], str(Path(torch.__file__).parent),
    str(Path(__file__).resolve().parents[1])})


class _Frame(TypedDict):
    file: str
    line: int
    function: str


class _Group(TypedDict):
    axis: str
    ranks: list[int]


class _Progress(TypedDict):
    enqueued: int
    completed: int


class _Collective(TypedDict):
    group: str
    sequence: int
    op: str
    sizes: Any
    finished: bool
    created_ns: int | None


class Record(TypedDict):
    """One rank's ``hang_rank<R>.json``, as ``write_record`` writes it."""

    run: str
    written: FiniteFloat
    rank: Annotated[int, Field(ge=0)]
    world_size: Annotated[int, Field(ge=1, le=MAX_WORLD_SIZE)]
    global_step: int
    epoch: int
    stuck_seconds: FiniteFloat
    stack: list[_Frame]
    groups: dict[str, _Group]
    recorder: str | None
    status: dict[str, _Progress]
    entries: list[_Collective]


class _Emitted(TypedDict):
    run: str
    records: dict[int, float]


_RECORD = TypeAdapter(Record)
_EMITTED = TypeAdapter(_Emitted)


def write_record(directory: Path, run: str, rank: int, world_size: int, step: int, epoch: int,
                 stuck: float, mesh: Any | None) -> Path:
    """Write this rank's ``hang_rank<R>.json`` (as a whole, never through a symlink) and
    return its path.

    Args:
        run: Names the run (the same on every rank), so that records left in ``directory``
            by another run are not mixed in.
    """
    main = sys._current_frames().get(threading.main_thread().ident or -1)
    frames = [] if main is None else [
        {"file": frame.filename, "line": frame.lineno, "function": frame.name}
        for frame in traceback.extract_stack(main)]
    record = {"run": run, "written": time.time(), "rank": rank, "world_size": world_size,
              "global_step": step, "epoch": epoch,
              "stuck_seconds": round(stuck, 1), "stack": frames, "groups": _groups(mesh),
              **_collectives()}
    return write_file(directory, RECORD.format(rank=rank),
                      json.dumps(record, indent=1).encode())


def _groups(mesh: Any | None) -> dict[str, dict[str, Any]]:
    """Process-group name -> the mesh axis it serves and its ranks (no collective needed)."""
    if not is_launched():
        return {}
    groups: dict[str, dict[str, Any]] = {}
    for axis in (mesh.mesh_dim_names or ()) if mesh is not None else ():
        group = mesh.get_group(axis)
        groups.setdefault(group.group_name, {"axis": axis,
                                             "ranks": dist.get_process_group_ranks(group)})
    # A mesh axis over every rank may reuse the default group: it keeps the axis's name.
    groups.setdefault(dist.group.WORLD.group_name,
                      {"axis": "world", "ranks": list(range(dist.get_world_size()))})
    return groups


def _collectives() -> dict[str, Any]:
    """The flight recorder's entries and per-group status, as plain values."""
    if not is_launched():
        return {"recorder": None, "status": {}, "entries": []}
    import torch._C._distributed_c10d as c10d

    dump = getattr(c10d, "_dump_fr_trace", None)
    try:
        # This process's own dump, read back in this process: nothing foreign is unpickled.
        trace = pickle.loads(dump()) if dump is not None else {}
    except RuntimeError:  # a torch without a recorder for this backend
        trace = {}
    entries = [{"group": entry["process_group"][0], "sequence": entry["collective_seq_id"],
                "op": str(entry["profiling_name"]).split(":")[-1],
                "sizes": entry.get("input_sizes"), "finished": bool(entry.get("retired")),
                "created_ns": entry.get("time_created_ns")}
               for entry in trace.get("entries", []) if not entry.get("is_p2p")]
    return {"recorder": dist.get_backend() if entries else None,
            "status": {name: {"enqueued": state.get("last_enqueued_collective", -1),
                              "completed": state.get("last_completed_collective", -1)}
                       for name, state in trace.get("pg_status", {}).items()},
            "entries": entries}


def report_once(directory: Path, run: str, rank: int, world_size: int, wait: float,
                emit: Callable[[str], None]) -> bool:
    """Have one rank emit the verdict on ``run``'s hang before any ended rank returns.

    Each ended rank calls this after writing its record and exits when it returns. It waits up
    to ``wait`` seconds for every rank's record. The lowest rank among them then emits the
    verdict and marks it out (``hang_verdict.json`` lists the records it covered); each other
    rank waits, up to ``wait`` seconds more, until the mark covers its own record, and emits
    a verdict itself if none does. No rank returns before a verdict with its record is out,
    whichever watchdog fired first: torchrun's agent, which ends every rank once one exits,
    finds it printed. The others cannot count on outliving the first to exit (SIGTERM ends a
    rank blocked in a collective at once; a Python handler would run only in its main
    thread), and every rank printing it would repeat it once per rank. The printer is the
    lowest rank with a record rather than rank 0, so that a verdict comes out when rank 0
    wrote none (ended before its watchdog fired, or its files on another host's disk).

    Returns:
        Whether this rank emitted the verdict.
    """
    deadline = time.monotonic() + wait
    records = read_records(directory, run, lenient=True)
    while len(records) < world_size and time.monotonic() < deadline:
        time.sleep(_POLL)
        records = read_records(directory, run, lenient=True)
    mine = records.get(rank)
    if mine is not None and rank != min(records):
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            covered = _emitted(directory, run)
            if covered.get(rank) == mine["written"]:
                return False
            if any(records[r]["written"] == written for r, written in covered.items()
                   if r in records):
                break  # out for this hang, but without this rank's record: emit a fuller one
            time.sleep(_POLL)
        records = read_records(directory, run, lenient=True)
    emit(verdict(records))
    # Marked only once emitted: a rank that sees the mark exits, and may so end this one.
    write_file(directory, EMITTED, json.dumps(
        {"run": run, "records": {r: record["written"] for r, record in records.items()}
         }).encode())
    return True


def _emitted(directory: Path, run: str) -> dict[int, float]:
    """Rank -> the ``written`` time of each record the emitted verdict on ``run`` covered."""
    try:
        mark = _EMITTED.validate_json(_read_regular(directory / EMITTED))
    except (OSError, ValidationError):  # none yet
        return {}
    return mark["records"] if mark["run"] == run else {}


SAME_HANG = 600.0
"""Seconds within which the records of one run belong to one hang."""


def read_records(directory: Path, run: str | None = None,
                 lenient: bool = False) -> dict[int, Record]:
    """The records in ``directory`` of ``run`` (by default the newest record's run), by rank,
    leaving out any written long before the newest (an earlier hang of the same run).

    Args:
        lenient: Leave out files that are not valid records, and return an empty dict when
            there is none, instead of raising.

    Raises:
        FileNotFoundError: if there is no record.
        ValueError: if a file is not a valid record, naming it and what is wrong, or the
            records of the run disagree on its world size.
    """
    found: list[tuple[Path, Record]] = []
    for path in sorted(directory.glob("hang_rank*.json")):
        try:
            found.append((path, _load(path)))
        except ValueError:
            if not lenient:
                raise
    if run is None and found:
        run = max(found, key=lambda item: item[1]["written"])[1]["run"]
    mine = [(path, record) for path, record in found if record["run"] == run]
    newest = max((record["written"] for _, record in mine), default=0.0)
    mine = [item for item in mine if item[1]["written"] > newest - SAME_HANG]
    sizes = {record["world_size"]: path for path, record in mine}
    if len(sizes) > 1 and not lenient:
        claims = ", ".join(f"{path.name} says {size}" for size, path in sizes.items())
        raise ValueError(f"the records of run {run!r} in {directory} disagree on its world "
                         f"size ({claims}): move the records of other runs out of it")
    records = {record["rank"]: record for _, record in sorted(
        mine, key=lambda item: item[1]["written"])}
    if not records and not lenient:
        raise FileNotFoundError(f"no hang_rank<R>.json in {directory}: HangWatchdog writes them "
                                "to its trace_dir when it ends a hung rank")
    return records


def _load(path: Path) -> Record:
    """``path`` as a record, checked against the format ``write_record`` writes.

    Raises:
        ValueError: naming ``path`` and what is wrong with it.
    """
    try:
        record = _RECORD.validate_json(_read_regular(path))
    except OSError as exc:
        raise ValueError(f"{path} cannot be read ({exc.strerror or exc}): move it out of the "
                         "directory to judge from the other records") from None
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(map(str, error['loc'])) or 'its content'}: {error['msg']}"
            for error in exc.errors(include_url=False)[:3])
        raise ValueError(f"{path} is not a hang record as HangWatchdog writes it ({problems}): "
                         "move it out of the directory to judge from the other records") \
            from None
    if record["rank"] >= record["world_size"]:
        raise ValueError(f"{path} is not a hang record as HangWatchdog writes it (rank "
                         f"{record['rank']} is not below its world_size "
                         f"{record['world_size']}): move it out of the directory to judge "
                         "from the other records")
    return record


def _read_regular(path: Path) -> bytes:
    """The bytes of ``path`` if it is a regular file (a symlink to one included).

    Raises:
        OSError: if it cannot be read, holds more than ``MAX_RECORD_BYTES``, or is something
            else: a device (``/dev/zero`` would never end) or a FIFO (which would block),
            opened without blocking to find out.
    """
    descriptor = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    with os.fdopen(descriptor, "rb") as file:
        if not stat.S_ISREG(os.fstat(file.fileno()).st_mode):
            raise OSError(errno.EINVAL, "not a regular file")
        try:
            return read_bounded(file, "it", MAX_RECORD_BYTES)
        except ValueError as exc:
            raise OSError(errno.EFBIG, str(exc)) from None


def where(record: Mapping[str, Any]) -> str:
    """The frame a rank's main thread is in: its innermost frame in the user's code (outside
    the standard library, installed packages, torch and dream_trainer), else its innermost."""
    stack = record["stack"]
    if not stack:
        return "an unknown frame (no stack recorded)"
    frame = next((f for f in reversed(stack) if not _in_library(f["file"])), stack[-1])
    # The names come from a file anyone could write: escaped, they cannot drive a terminal.
    return printable(f"{Path(frame['file']).name}:{frame['line']} in {frame['function']}")


@functools.lru_cache(maxsize=4096)  # a real stack repeats its files
def _in_library(file: str) -> bool:
    return str(Path(file).resolve()).startswith(_LIBRARIES)


def _in_collective(record: Mapping[str, Any]) -> bool:
    return any("torch/distributed" in f["file"].replace("\\", "/") for f in record["stack"])


def verdict(records: Mapping[int, Mapping[str, Any]]) -> str:
    """One report of who is behind, in which collective, and where each lagging rank is."""
    world_size = max(int(r["world_size"]) for r in records.values())
    lines = [f"hang verdict over {len(records)} of {world_size} ranks "
             f"(global steps: {_steps(records)})"]
    if len(records) < world_size:
        lines.append(f"no record from ranks [{_absent(records, world_size)}]: they wrote none "
                     "(killed first, or their files are on another machine's disk)")
    stuck = _first_disagreement(records)
    if stuck is None:
        lines += _from_stacks(records)
        return "\n".join(lines)
    group, sequence, op, axis, ahead, behind = stuck
    group, op, axis = printable(group), printable(op), printable(axis)
    lines.append(f"ranks {ahead} entered {op} #{sequence} on {axis} (process group {group}); "
                 f"ranks {behind} never did")
    for rank in behind:
        lines.append(f"rank {rank} never entered {op} #{sequence} on {axis}; it is at "
                     f"{where(records[rank])}")
    for rank in ahead:
        lines.append(f"rank {rank} waits in {op} #{sequence} on {axis}, at "
                     f"{where(records[rank])}")
    return "\n".join(lines)


def _absent(present: Iterable[int], world_size: int) -> str:
    """The ranks below ``world_size`` not in ``present``, runs of them as ``first-last``: a
    record claiming a million ranks costs a short line, not a list of a million."""
    spans = []
    start = 0
    for rank in [*sorted(present), world_size]:
        if rank > start:
            spans.append(str(start) if rank == start + 1 else f"{start}-{rank - 1}")
        start = rank + 1
    return ", ".join(spans)


def _steps(records: Mapping[int, Mapping[str, Any]]) -> str:
    return ", ".join(f"rank {rank}: {record['global_step']}"
                     for rank, record in sorted(records.items()))


def _first_disagreement(records: Mapping[int, Mapping[str, Any]]
                        ) -> tuple[str, int, str, str, list[int], list[int]] | None:
    """The earliest collective some members of a group entered and others did not.

    Linear in the records' size: each status, group and entry is read once (looking up each
    group's entry among every ahead rank's entries cost the groups times the entries, 20
    minutes for 30 MB of records).
    """
    groups: dict[str, dict[str, Any]] = {}
    enqueued: dict[str, dict[int, int]] = {}  # group name -> rank -> last enqueued
    first: dict[tuple[str, int], list[tuple[int, Any]]] = {}  # each rank's first entry
    for rank, record in records.items():
        for name, group in record.get("groups", {}).items():
            groups.setdefault(name, group)
        for name, progress in record.get("status", {}).items():
            enqueued.setdefault(name, {})[rank] = int(progress.get("enqueued", -1))
    for rank in sorted(records):
        seen = set()
        for entry in records[rank]["entries"]:
            key = (entry["group"], entry["sequence"])
            if key not in seen:
                seen.add(key)
                first.setdefault(key, []).append((rank, entry))
    best: tuple[int, str, int, Any] | None = None
    for name in sorted(enqueued):
        entered = _entered(name, enqueued[name], groups, records)
        values = set(entered.values()) if entered is not None else \
            {*enqueued[name].values(), *([-1] if len(enqueued[name]) < len(records) else [])}
        if len(values) < 2:
            continue
        sequence = min(values) + 1
        entry = next((e for r, e in first.get((name, sequence), [])
                      if _last(r, enqueued[name], entered) >= sequence), None)
        created = entry["created_ns"] if entry and entry.get("created_ns") else 0
        if best is None or created < best[0]:
            best = (created, name, sequence, entry)
    if best is None:
        return None
    _, name, sequence, entry = best
    entered = _entered(name, enqueued[name], groups, records)
    ahead = sorted(r for r in (records if entered is None else entered)
                   if _last(r, enqueued[name], entered) >= sequence)
    behind = sorted(r for r in (records if entered is None else entered)
                    if _last(r, enqueued[name], entered) < sequence)
    axis = groups.get(name, {}).get("axis", f"process group {name}")
    return name, sequence, entry["op"] if entry else "collective", axis, ahead, behind


def _last(rank: int, enqueued: Mapping[int, int],
          entered: Mapping[int, int] | None) -> float:
    """The last collective ``rank`` enqueued in a group (-1: none); for a rank that is not a
    member of a group whose ranks are named (``entered``), minus infinity, below any."""
    if entered is None:
        return enqueued.get(rank, -1)
    return entered.get(rank, -math.inf)


def _entered(name: str, enqueued: Mapping[int, int], groups: Mapping[str, Mapping[str, Any]],
             records: Mapping[int, Any]) -> dict[int, int] | None:
    """Member rank -> its last enqueued collective of the group ``name``, for a group whose
    ranks a record names; None for one that names none (every rank with a record is then a
    member, and the caller reads ``enqueued`` sparsely rather than once per rank)."""
    if name not in groups:
        return None
    return {r: enqueued.get(r, -1) for r in groups[name]["ranks"] if r in records}


def _from_stacks(records: Mapping[int, Mapping[str, Any]]) -> list[str]:
    recorded = any(record.get("entries") for record in records.values())
    lines = ["the collective records show no disagreement" if recorded else
             ("no collective was recorded (the flight recorder is off, or the backend records "
              "none): this verdict comes from the stacks alone")]
    waiting = sorted(r for r, record in records.items() if _in_collective(record))
    waits = set(waiting)
    elsewhere = sorted(set(records) - set(waiting))
    if waiting and elsewhere:
        lines.append(f"ranks {waiting} wait in a collective; ranks {elsewhere} are not in one")
    for rank in sorted(records):
        state = "waits in a collective" if rank in waits else "is"
        lines.append(f"rank {rank} {state} at {where(records[rank])}")
    return lines
