"""What each rank was doing when a run hung, and the verdict drawn from all of them.

When ``HangWatchdog`` ends a rank it writes ``hang_rank<R>.json``: the rank's step, the frames
of its main thread, its process groups (with the mesh axis each serves) and its flight
recorder's collectives (sequence number, operation, sizes, whether finished). ``verdict``
reads every rank's file and says which ranks are behind, the first collective they never
entered (by process group, mesh axis and sequence number) and the frame each is in; where
the backend recorded no collectives, it judges from the stacks alone and says so.
``dream-trainer diagnose DIR`` prints it.
"""

from __future__ import annotations

import json
import os
import pickle
import sys
import sysconfig
import threading
import time
import traceback
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

RECORD = "hang_rank{rank}.json"
_LIBRARIES = tuple(str(Path(p).resolve()) for p in {
    sysconfig.get_paths()["stdlib"], sysconfig.get_paths()["purelib"],
    sysconfig.get_paths()["platlib"], str(Path(torch.__file__).parent),
    str(Path(__file__).resolve().parents[1])})


def write_record(directory: Path, run: str, rank: int, world_size: int, step: int, epoch: int,
                 stuck: float, mesh: Any | None) -> Path:
    """Write this rank's ``hang_rank<R>.json`` (atomically) and return its path.

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
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / RECORD.format(rank=rank)
    temporary = path.with_suffix(".tmp")
    temporary.write_text(json.dumps(record, indent=1))
    os.replace(temporary, path)
    return path


def _groups(mesh: Any | None) -> dict[str, dict[str, Any]]:
    """Process-group name -> the mesh axis it serves and its ranks (no collective needed)."""
    if not (dist.is_available() and dist.is_initialized()):
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
    if not (dist.is_available() and dist.is_initialized()):
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


def wait_for_records(directory: Path, run: str, world_size: int, seconds: float) -> None:
    """Wait up to ``seconds`` until every rank of ``run`` has written its record."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if len(read_records(directory, run, missing_ok=True)) == world_size:
            return
        time.sleep(0.1)


SAME_HANG = 600.0
"""Seconds within which the records of one run belong to one hang."""


def read_records(directory: Path, run: str | None = None,
                 missing_ok: bool = False) -> dict[int, dict[str, Any]]:
    """The records in ``directory`` of ``run`` (by default the newest record's run), by rank,
    leaving out any written long before the newest (an earlier hang of the same run).

    Raises:
        FileNotFoundError: if there is none (unless ``missing_ok``).
    """
    found = []
    for path in sorted(directory.glob("hang_rank*.json")):
        try:
            found.append(json.loads(path.read_text()))
        except (OSError, ValueError):  # being replaced by its writer
            continue
    if run is None and found:
        run = max(found, key=lambda record: record["written"])["run"]
    mine = [record for record in found if record["run"] == run]
    newest = max((record["written"] for record in mine), default=0.0)
    records = {int(record["rank"]): record for record in mine
               if record["written"] > newest - SAME_HANG}
    if not records and not missing_ok:
        raise FileNotFoundError(f"no hang_rank<R>.json in {directory}: HangWatchdog writes them "
                                "to its trace_dir when it ends a hung rank")
    return records


def where(record: Mapping[str, Any]) -> str:
    """The frame a rank's main thread is in: its innermost frame in the user's code (outside
    the standard library, installed packages, torch and dream_trainer), else its innermost."""
    stack = record["stack"]
    if not stack:
        return "an unknown frame (no stack recorded)"
    mine = [f for f in stack if not str(Path(f["file"]).resolve()).startswith(_LIBRARIES)]
    frame = (mine or stack)[-1]
    return f"{Path(frame['file']).name}:{frame['line']} in {frame['function']}"


def _in_collective(record: Mapping[str, Any]) -> bool:
    return any("torch/distributed" in f["file"].replace("\\", "/") for f in record["stack"])


def verdict(records: Mapping[int, Mapping[str, Any]]) -> str:
    """One report of who is behind, in which collective, and where each lagging rank is."""
    world_size = max(int(r["world_size"]) for r in records.values())
    missing = sorted(set(range(world_size)) - set(records))
    lines = [f"hang verdict over {len(records)} of {world_size} ranks "
             f"(global steps: {_steps(records)})"]
    if missing:
        lines.append(f"no record from ranks {missing}: they wrote none (killed first, or their "
                     "files are on another machine's disk)")
    stuck = _first_disagreement(records)
    if stuck is None:
        lines += _from_stacks(records)
        return "\n".join(lines)
    group, sequence, op, axis, ahead, behind = stuck
    lines.append(f"ranks {ahead} entered {op} #{sequence} on {axis} (process group {group}); "
                 f"ranks {behind} never did")
    for rank in behind:
        lines.append(f"rank {rank} never entered {op} #{sequence} on {axis}; it is at "
                     f"{where(records[rank])}")
    for rank in ahead:
        lines.append(f"rank {rank} waits in {op} #{sequence} on {axis}, at "
                     f"{where(records[rank])}")
    return "\n".join(lines)


def _steps(records: Mapping[int, Mapping[str, Any]]) -> str:
    return ", ".join(f"rank {rank}: {record['global_step']}"
                     for rank, record in sorted(records.items()))


def _first_disagreement(records: Mapping[int, Mapping[str, Any]]
                        ) -> tuple[str, int, str, str, list[int], list[int]] | None:
    """The earliest collective some members of a group entered and others did not."""
    found = []
    groups: dict[str, dict[str, Any]] = {}
    for record in records.values():
        for name, group in record.get("groups", {}).items():
            groups.setdefault(name, group)
    names = {name for record in records.values() for name in record.get("status", {})}
    for name in sorted(names):
        members = [r for r in groups.get(name, {}).get("ranks", sorted(records)) if r in records]
        entered = {r: int(records[r].get("status", {}).get(name, {}).get("enqueued", -1))
                   for r in members}
        if len(set(entered.values())) < 2:
            continue
        sequence = min(entered.values()) + 1
        ahead = sorted(r for r, last in entered.items() if last >= sequence)
        behind = sorted(r for r, last in entered.items() if last < sequence)
        entry = next((e for r in ahead for e in records[r]["entries"]
                      if e["group"] == name and e["sequence"] == sequence), None)
        op = entry["op"] if entry else "collective"
        created = entry["created_ns"] if entry and entry.get("created_ns") else 0
        axis = groups.get(name, {}).get("axis", f"process group {name}")
        found.append((created, (name, sequence, op, axis, ahead, behind)))
    return min(found, key=lambda item: item[0])[1] if found else None


def _from_stacks(records: Mapping[int, Mapping[str, Any]]) -> list[str]:
    recorded = any(record.get("entries") for record in records.values())
    lines = ["the collective records show no disagreement" if recorded else
             ("no collective was recorded (the flight recorder is off, or the backend records "
              "none): this verdict comes from the stacks alone")]
    waiting = sorted(r for r, record in records.items() if _in_collective(record))
    elsewhere = sorted(set(records) - set(waiting))
    if waiting and elsewhere:
        lines.append(f"ranks {waiting} wait in a collective; ranks {elsewhere} are not in one")
    for rank in sorted(records):
        state = "waits in a collective" if rank in waiting else "is"
        lines.append(f"rank {rank} {state} at {where(records[rank])}")
    return lines
