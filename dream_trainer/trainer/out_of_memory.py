"""What an out-of-memory failure says: where it happened, the memory held, and what to change.

Nothing here runs until a run has already failed: the phase is read from the exception's
traceback, not tracked per step, so a run that never runs out of memory pays nothing.
"""

from __future__ import annotations

import resource
import sys
from dataclasses import dataclass
from types import TracebackType

import torch

from dream_trainer.configs.device import DeviceParameters
from dream_trainer.configs.training import TrainingParameters
from dream_trainer.trainer.config import BaseTrainerConfig
from dream_trainer.world.dims import ParallelDims
from dream_trainer.world.world import DistributedWorld

# The CPU allocator's failure is a plain RuntimeError; these are its messages (c10's
# DefaultCPUAllocator) and the CUDA caching allocator's, for builds that raise it untyped.
_ALLOCATOR_MESSAGES = ("DefaultCPUAllocator: can't allocate memory", "CUDA out of memory")

# (module, function) of the frames that mark a phase. torch's backward frames are there for a
# user who calls loss.backward() directly and for pipeline schedules; names rather than code
# objects, so that this module imports neither the loop nor the step API.
_PHASE_FRAMES = {
    ("dream_trainer.trainer.base", "_train_batch"): "forward",
    ("dream_trainer.trainer.step_api", "backward"): "backward",
    ("torch._tensor", "backward"): "backward",
    ("torch.autograd", "backward"): "backward",
    ("torch.autograd", "grad"): "backward",
    ("torch.autograd.graph", "_engine_run_backward"): "backward",
    ("dream_trainer.trainer.step_api", "step"): "optimizer",
    ("dream_trainer.trainer.validation", "_validation_epoch"): "validation",
}
_PHASE_MODULES = (("torch.optim", "optimizer"), ("torch.distributed.checkpoint", "checkpoint"),
                  ("dream_trainer.checkpoint", "checkpoint"),
                  ("dream_trainer.mixins.checkpoint", "checkpoint"))

PHASES = ("forward", "backward", "optimizer", "validation", "checkpoint")
"""The phases a message names. ``forward`` is coarse: the training step outside
``backward()`` and ``step()`` (the model's forward, the loss, and the train-batch hooks)."""


def is_out_of_memory(exc: BaseException) -> bool:
    """Whether ``exc`` is an allocation failure: ``torch.OutOfMemoryError``, ``MemoryError``,
    or the CPU allocator's ``RuntimeError``."""
    if isinstance(exc, (torch.OutOfMemoryError, MemoryError)):
        return True
    return isinstance(exc, RuntimeError) and any(text in str(exc)
                                                 for text in _ALLOCATOR_MESSAGES)


def failing_phase(traceback: TracebackType | None) -> str | None:
    """The phase (one of ``PHASES``) of the innermost frame of ``traceback`` that marks one,
    or None when none does (setup, a hook outside the loop, teardown).

    Args:
        traceback: The exception's ``__traceback__``, from where it was caught inwards.
    """
    phase = None
    while traceback is not None:
        frame = traceback.tb_frame
        module = str(frame.f_globals.get("__name__", ""))
        found = _PHASE_FRAMES.get((module, frame.f_code.co_name))
        if found is None:
            found = next((name for prefix, name in _PHASE_MODULES
                          if module == prefix or module.startswith(prefix + ".")), None)
        if found is not None:
            phase = found
        traceback = traceback.tb_next
    return phase


@dataclass(frozen=True)
class MemoryUse:
    """Bytes in use and the peak since the process started, and what they count."""

    what: str
    in_use: int | None
    peak: int | None


def memory_use(device: torch.device) -> MemoryUse:
    """The memory this rank holds: CUDA tensors on a CUDA device, else the process's
    resident set (now and its peak, from ``/proc/self/statm`` and ``getrusage``)."""
    if device.type == "cuda":
        return MemoryUse(f"allocated by tensors on {device}", torch.cuda.memory_allocated(device),
                         torch.cuda.max_memory_allocated(device))
    resident = _resident_bytes()
    # The kernel updates the high-water mark lazily: it can trail the resident set just read.
    peak = _peak_rss() if resident is None else max(resident, _peak_rss())
    return MemoryUse("resident in this process's host memory", resident, peak)


def _resident_bytes() -> int | None:
    try:
        with open("/proc/self/statm") as statm:
            pages = int(statm.read().split()[1])
    except (OSError, IndexError, ValueError):  # not Linux: the peak alone is reported
        return None
    return pages * resource.getpagesize()


def _peak_rss() -> int:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    # Linux reports kibibytes, macOS bytes.
    return peak if sys.platform == "darwin" else peak * 1024


def format_bytes(n: int | None) -> str:
    """``n`` bytes in binary units, three significant digits; "unknown" for None."""
    if n is None:
        return "unknown"
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n} B"


def remedies(phase: str | None, device: DeviceParameters, training: TrainingParameters,
             dims: ParallelDims) -> list[str]:
    """Settings that lower this phase's memory, the cheapest first (recomputation, then
    offload, then smaller micro-batches, then more sharding).

    Args:
        phase: One of ``PHASES``, or None.
        device: The run's device parameters (for its checkpointing policy and offload).
        training: The run's training parameters (for its batch sizes).
        dims: The resolved mesh degrees ("auto" already a number).
    """
    found: list[str] = []
    if phase in ("forward", "backward"):
        stronger = _stronger_checkpointing(device.activation_checkpointing)
        if stronger is not None:
            found.append(f"device_parameters.activation_checkpointing={stronger!r} (recomputes "
                         "activations in backward instead of keeping them)")
        if _can_offload(device):
            found.append("device_parameters.activation_offload=True (moves what the blocks "
                         "save for backward to host memory until backward)")
        batch, accumulation = training.train_batch_size, training.gradient_accumulation_steps
        if batch > 1:
            found.append(f"training_parameters.train_batch_size={batch // 2} with "
                         f"gradient_accumulation_steps={accumulation * 2} (the same global "
                         f"batch when {batch} is even, in smaller micro-batches)")
    val_batch = training.val_batch_size or training.train_batch_size
    if phase == "validation" and val_batch > 1:
        found.append(f"training_parameters.val_batch_size={val_batch // 2}")
    if phase != "validation":
        found.append(_more_sharding(dims))
    # FSDP2 is what offloads, and it applies only over more than one shard.
    if phase == "optimizer" and dims.fsdp > 1 and not device.cpu_offload:
        found.append("device_parameters.cpu_offload=True (FSDP2 keeps parameters, gradients "
                     "and optimizer state in host memory)")
    return found


def _stronger_checkpointing(policy: object) -> object | None:
    """The next policy that keeps fewer activations: none, selective, every N-th, full."""
    if policy is None:
        return "selective"
    if policy == "selective":
        return 2
    if isinstance(policy, int) and policy > 3:  # 3 and 2 halve to every block: "full"
        return policy // 2
    if policy == "full" or policy == 1:
        return None
    return "full"  # every 2nd block, or a user's policy function


def _can_offload(device: DeviceParameters) -> bool:
    """Whether turning ``activation_offload`` on passes the config's own checks."""
    policy = device.activation_checkpointing
    return not (device.activation_offload or device.compile_model or policy == "selective"
                or callable(policy))


def _more_sharding(dims: ParallelDims) -> str:
    if dims.dp_replicate > 1:
        return (f"device_parameters.dp_shard={dims.dp_shard * dims.dp_replicate} with "
                "dp_replicate=1 (shards parameters, gradients and optimizer state over the "
                "replicas too)")
    return (f"more ranks with a larger dp_shard (dp_shard={dims.dp_shard * 2} on "
            f"{dims.world_size * 2} ranks halves each rank's share of the sharded state)")


def failure_note(exc: BaseException, where: str, world: DistributedWorld,
                 config: BaseTrainerConfig) -> str:
    """What the failure message of ``exc`` adds: "" unless it is an out-of-memory error,
    else a newline and ``explain()``'s paragraph for this rank."""
    if not is_out_of_memory(exc):
        return ""
    try:
        phase = failing_phase(exc.__traceback__)
        suggestions = remedies(phase, config.device_parameters, config.training_parameters,
                               world.dims)
        return "\n  " + explain(exc, phase, where, memory_use(world.device), suggestions)
    except Exception as failure:  # the report of the run's own error must not replace it
        return f"\n  (out of memory; explaining it failed: {type(failure).__name__}: {failure})"


def explain(exc: BaseException, phase: str | None, where: str, memory: MemoryUse,
            suggestions: list[str]) -> str:
    """The paragraph that names an out-of-memory failure's place, memory and remedies.

    Args:
        exc: The allocation failure.
        phase: One of ``PHASES``, or None outside them (setup, a hook, teardown).
        where: The rank and step, as the failure message names them.
        memory: What this rank held when it failed.
        suggestions: ``remedies()``.
    """
    during = f"in the {phase} phase" if phase is not None else "outside a training step"
    lines = [
        f"out of memory on {where}, {during} ({type(exc).__name__})",
        f"memory {memory.what}: {format_bytes(memory.in_use)} in use, peak "
        f"{format_bytes(memory.peak)}",
        "planner estimate: not estimated (the planner runs a step of its own); run "
        "`dream-trainer plan <module:Trainer> --world-size <N> --device-memory <SIZE> "
        "--activation-policies` for this layout's memory per rank and per checkpointing "
        "policy",
    ]
    if suggestions:
        lines.append("settings that lower it, cheapest first: " + "; ".join(suggestions))
    return "\n  ".join(lines)
