"""A plan's figures as a scaling table or as one JSON object per world size."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from dream_trainer.planning.comms import AxisTraffic
from dream_trainer.planning.saved import SavedActivations

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}

MEASURED = (
    "Measured on each simulated rank: the shapes and dtypes of every tensor; the bytes of its "
    "parameter and buffer storages, of its gradients as the optimizer receives them, and of "
    "the optimizer state after the step; the peak of every other tensor during the step "
    "(activations, FSDP's gathered parameters and unsharded gradients, temporaries, the "
    "micro-batch); every collective of the step with its process group and buffer size. "
    "'total' adds the four and so bounds the step's peak from above (gradients are counted "
    "whole). Not measured: time, bandwidth or overlap, kernels' workspaces, the CUDA context, "
    "NCCL buffers and allocator fragmentation; the config's callbacks are not run. "
    "Mixture-of-experts layers (dream_trainer.nn.MoE) are planned with balanced routing: "
    "every expert receives an equal share of the tokens (a real router's imbalance adds "
    "to the busiest expert's activations and all-to-all bytes)."
)

CONTEXT_PARALLEL = (
    "Under context parallelism the cp axis carries attention's all-gathers of every layer's "
    "keys and values (each buffer the whole sequence's; again when activation checkpointing "
    "recomputes them), the reduce-scatters of their gradients in backward (a run on gloo "
    "all-reduces them instead, the same bytes) and one all-reduce of the loss per "
    "micro-batch. FSDP2's traffic is on dp_shard_cp, or on cp where the two are one process "
    "group (a mesh of cp alone). The activations include the gathered keys and values that "
    "attention keeps for backward (every layer's, unless activations are checkpointed)."
)


@dataclass
class RankPlan:
    """What one rank holds and sends during one optimizer step (bytes are per rank)."""

    rank: int
    param_bytes: int
    """Parameters and buffers of every model, after the optimizer step."""
    grad_bytes: int
    """Gradients as the optimizer receives them (after reduction), before it steps."""
    optimizer_bytes: int
    """Optimizer state after the step (moments, step counters)."""
    activation_bytes: int
    """The step's peak of every other tensor: activations kept for backward, FSDP's gathered
    parameters and unsharded gradients, temporaries, and the micro-batch."""
    saved: SavedActivations | None
    """What the first micro-batch's forward kept for backward when backward began (on the
    device and offloaded to the host; ``planning.saved``), None if the step made no backward
    call."""
    collectives: dict[str, AxisTraffic]
    """Collectives of the whole step (every micro-batch), by mesh axis."""
    collective_kinds: dict[str, dict[str, AxisTraffic]]
    """The same by axis and kind (``all_gather``, ``reduce_scatter``, ``all_reduce``, ...)."""
    mesh: dict[str, int]
    steps_per_epoch: int
    micro_batches: int
    batch_source: str

    @property
    def total_bytes(self) -> int:
        """An upper bound of the step's peak: every gradient is counted as if alive at it."""
        return self.param_bytes + self.grad_bytes + self.optimizer_bytes + self.activation_bytes


@dataclass
class SizePlan:
    """The simulated ranks of one world size, or the error the run would raise at it."""

    world_size: int
    ranks: dict[int, RankPlan] = field(default_factory=dict)
    error: str | None = None

    @property
    def mesh(self) -> dict[str, int]:
        return next(iter(self.ranks.values())).mesh if self.ranks else {}

    def largest(self, key: str) -> int:
        """The largest value of a ``RankPlan`` attribute over the simulated ranks."""
        return max(getattr(plan, key) for plan in self.ranks.values())

    def fits(self, device_memory: int | None) -> bool | None:
        """Whether every simulated rank's total fits in ``device_memory`` (None: not asked)."""
        if device_memory is None or not self.ranks:
            return None
        return self.largest("total_bytes") <= device_memory


def parse_size(text: str) -> int:
    """``80GiB``, ``80GB``, ``1.5TiB`` or a number of bytes, as bytes.

    Raises:
        ValueError: naming the accepted forms.
    """
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    unit = match.group(2).lower() if match else ""
    if match is None or unit not in _UNITS:
        raise ValueError(f"{text!r} is not a memory size: write a number with an optional unit, "
                         "such as 80GiB, 141GB or 512MiB (B, KB, MB, GB, TB, KiB, MiB, GiB, TiB)")
    return int(float(match.group(1)) * _UNITS[unit])


def format_bytes(n: int) -> str:
    """``n`` bytes in binary units with three significant digits (``29.9 GiB``)."""
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n} B"


def to_json(plan: SizePlan, device_memory: int | None) -> dict[str, Any]:
    """The contract's JSON object for one world size (bytes as integers)."""
    return {
        "world_size": plan.world_size,
        "mesh": plan.mesh,
        "ranks": {str(rank): {
            "param_bytes": rank_plan.param_bytes,
            "grad_bytes": rank_plan.grad_bytes,
            "optimizer_bytes": rank_plan.optimizer_bytes,
            "activation_bytes": rank_plan.activation_bytes,
            "saved_activation_bytes": (rank_plan.saved.device_bytes
                                       if rank_plan.saved is not None else None),
            "offloaded_activation_bytes": (rank_plan.saved.host_bytes
                                           if rank_plan.saved is not None else None),
            "collectives": {axis: {"count": traffic.count, "bytes": traffic.bytes}
                            for axis, traffic in rank_plan.collectives.items()},
        } for rank, rank_plan in plan.ranks.items()},
        "fits": plan.fits(device_memory),
    }


def table(plans: list[SizePlan], device_memory: int | None) -> str:
    """Two tables, one row per planned world size: memory per rank, then collectives."""
    plans = [plan for plan in plans if plan.ranks]
    if not plans:
        return ""
    fit_title = f"fits in {format_bytes(device_memory)}" if device_memory is not None else ""
    memory_rows = [["world size", "mesh", "steps/epoch", "params", "grads", "optimizer",
                    "activations", "total", fit_title]]
    for plan in plans:
        memory_rows.append([
            str(plan.world_size), _mesh(plan.mesh), str(plan.largest("steps_per_epoch")),
            *(format_bytes(plan.largest(key)) for key in (
                "param_bytes", "grad_bytes", "optimizer_bytes", "activation_bytes",
                "total_bytes")),
            _fit(plan, device_memory),
        ])
    axes = sorted({axis for plan in plans for rank in plan.ranks.values()
                   for axis in rank.collectives})
    comm_rows = [["world size", *axes]]
    for plan in plans:
        cells = []
        for axis in axes:
            counts = [rank.collectives[axis] for rank in plan.ranks.values()
                      if axis in rank.collectives]
            cells.append(f"{max(t.count for t in counts)} x, "
                         f"{format_bytes(max(t.bytes for t in counts))}" if counts else "-")
        comm_rows.append([str(plan.world_size), *cells])
    sections = ["per rank (the larger figure of the simulated ranks):", _columns(memory_rows)]
    if axes:
        sections += ["", "collectives of one optimizer step per rank, by mesh axis "
                         "(count, bytes of their full buffers):", _columns(comm_rows)]
    return "\n".join(sections)


POLICIES: tuple[tuple[str, int | str | None, bool], ...] = (
    ("none", None, False), ("selective", "selective", False), ("every 2nd block", 2, False),
    ("full", "full", False), ("every 2nd block, offloaded", 2, True),
    ("full, offloaded", "full", True))
"""The rows of ``plan --activation-policies``: (label, ``activation_checkpointing``,
``activation_offload``), from the most kept to the least."""

SAVED = (
    "Saved for backward: what the first micro-batch's forward leaves alive when its backward "
    "begins (activations autograd saved, checkpointed blocks' inputs, the outputs a selective "
    "policy keeps, the loss), parameters and the micro-batch aside; 'on host' is what "
    "activation offloading copied to host memory instead. 'activations' is the step's peak "
    "as in the table above (with offload it counts the host copies too: the plan does not "
    "tell host from device memory). `dream-trainer summarize --activations` measures the "
    "same bytes in one real step of each policy."
)


def policy_table(rows: list[tuple[str, RankPlan | SavedActivations | str]]) -> str:
    """One row per activation policy: the bytes saved for backward on the device and on the
    host, with a plan's peak and total; or, below the table, why a policy was not run."""
    planned = any(isinstance(value, RankPlan) for _, value in rows)
    header = ["policy", "saved for backward", "on host"]
    lines = [header + (["activations", "total"] if planned else [])]
    notes = []
    for label, value in rows:
        cells = [label]
        if isinstance(value, str):
            cells.append("not run (below)")
            notes.append(f"{label}: {value}")
        else:
            saved = value.saved if isinstance(value, RankPlan) else value
            cells += ([format_bytes(saved.device_bytes), format_bytes(saved.host_bytes)]
                      if saved is not None else ["no backward call", ""])
            if isinstance(value, RankPlan):
                cells += [format_bytes(value.activation_bytes), format_bytes(value.total_bytes)]
        lines.append(cells + [""] * (len(lines[0]) - len(cells)))
    return "\n".join([_columns(lines), *notes])


def _mesh(mesh: dict[str, int]) -> str:
    return " x ".join(f"{axis}={degree}" for axis, degree in mesh.items()) or "none"


def _fit(plan: SizePlan, device_memory: int | None) -> str:
    if device_memory is None:
        return ""
    margin = device_memory - plan.largest("total_bytes")
    return (f"yes, {format_bytes(margin)} spare" if margin >= 0
            else f"no, {format_bytes(-margin)} short")


def _columns(rows: list[list[str]]) -> str:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip()
                     for row in rows)
