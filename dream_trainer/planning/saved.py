"""What a step's forward leaves for backward: the saved activations, measured at the moment
the step's first backward begins.

Both ``dream-trainer plan`` (fake tensors) and ``dream-trainer summarize --activations``
(one real step on the CPU) read the figure the same way, from a ``StepMemory`` that follows
every storage the step creates: when the first ``torch.autograd.backward`` call of the step
is made (``loss.backward()``, a pipeline stage's backward), the storages created since the
step began and still alive are what forward kept, whoever keeps them: autograd's saved
tensors, a checkpoint's inputs and the outputs a selective policy caches, the loss. The
models' parameters and buffers are left out (FSDP2's gathered parameters among them), and so
are tensors created before the step (the micro-batch). Under activation offloading the host
copies the blocks made are reported apart from what stays on the device.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from dream_trainer.parallel.offload import offload_stats
from dream_trainer.planning.memory import StepMemory, storages


@dataclass(frozen=True)
class SavedActivations:
    """Bytes a step's first micro-batch kept for backward when its backward began."""

    device_bytes: int
    """Kept on the device: everything forward left alive but the offloaded host copies."""
    host_bytes: int
    """Copied to host memory by activation offloading (0 without it)."""

    @property
    def total_bytes(self) -> int:
        return self.device_bytes + self.host_bytes


def _offloaded(models: Mapping[str, nn.Module]) -> int:
    """Bytes the models' offloading blocks have copied to the host so far."""
    return sum(offload_stats(model).offloaded_bytes for model in models.values())


@contextmanager
def at_first_backward(models: Mapping[str, nn.Module],
                      memory: StepMemory) -> Iterator[list[SavedActivations]]:
    """Within the block, measure what is saved for backward when the first backward starts.

    ``memory`` must be active around the step (entered before its forward). The yielded list
    receives one ``SavedActivations`` at the first ``torch.autograd.backward`` call, and
    stays empty if the block makes none. ``torch.autograd.backward`` is wrapped for the
    block's duration (``Tensor.backward`` calls it by that name) and restored after.

    Args:
        models: The trainer's models (``named_models()``), whose parameters and buffers
            are not activations.
        memory: The tracker of the step's storages.
    """
    found: list[SavedActivations] = []
    offloaded_before = _offloaded(models)
    original = torch.autograd.backward

    def backward(*args: Any, **kwargs: Any) -> Any:
        if not found:
            state = storages(itertools.chain.from_iterable(
                itertools.chain(model.parameters(), model.buffers())
                for model in models.values()))
            excluded = {memory.allocation_of(storage) for storage in state.values()}
            host = _offloaded(models) - offloaded_before
            found.append(SavedActivations(memory.live_bytes(excluded - {None}) - host, host))
        return original(*args, **kwargs)

    torch.autograd.backward = backward  # type: ignore[assignment]
    try:
        yield found
    finally:
        torch.autograd.backward = original


def measure_real_step(trainer: Any) -> SavedActivations:
    """One real optimizer step of a set-up trainer on the first micro-batches of its train
    loader, measured with ``at_first_backward``: what ``summarize --activations`` reports.

    Raises:
        ValueError: if the loader yields fewer micro-batches than one optimizer step takes,
            or the step makes no backward call.
    """
    count = trainer.training_parameters.gradient_accumulation_steps
    batches = list(itertools.islice(iter(trainer.train_dataloader), count))
    if len(batches) < count:
        raise ValueError(f"the train loader yielded {len(batches)} batches, fewer than the "
                         f"gradient_accumulation_steps={count} of one optimizer step")
    memory = StepMemory()
    with memory, at_first_backward(trainer.named_models(), memory) as found:
        trainer.train_window(batches)
    if not found:
        raise ValueError("the training step made no backward call (torch.autograd.backward), "
                         "so nothing was saved for one: there is nothing to measure")
    return found[0]
