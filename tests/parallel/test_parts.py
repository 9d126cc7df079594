"""The layout's parts: one declared order (``PARTS``), the one the docs state; a new dimension
is added by declaring a part and placing it, with nothing else edited."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from dream_trainer.configs import DeviceParameters
from dream_trainer.parallel.blocks import find_blocks
from dream_trainer.parallel.layout import Layout
from dream_trainer.parallel.parts import PARTS, BuildHooks, Part, with_part
from dream_trainer.world import ParallelDims
from tests.helpers.toy import ToyTrainer, toy_config

DOCS = Path(__file__).parents[2] / "docs"


def documented_order() -> list[str]:
    """The part names of docs/concepts.md's "The build order" table, top to bottom."""
    text = (DOCS / "concepts.md").read_text()
    section = text.split("## The build order", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"^\| \d+ \| ([a-z0-9 ]+) \|", section, flags=re.MULTILINE)


def test_the_docs_state_the_declared_order() -> None:
    assert documented_order() == [part.name for part in PARTS]
    assert documented_order() == ["float8", "tensor", "expert", "activation checkpointing",
                                  "activation offload", "compile", "data parallel", "context"]


class Counting(nn.Module):
    """Runs its block unchanged and counts the training-mode forwards through it."""

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block = block
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += self.training
        return self.block(x)


class CountingPart(Part):
    """A toy dimension: every block of every model is wrapped in ``Counting``."""

    name = "counting"

    def active(self, params: DeviceParameters, dims: ParallelDims) -> bool:
        return True

    def on_meta(self, hooks: BuildHooks, layout: Layout) -> None:
        for model in hooks.named_models().values():
            for container, name, block in find_blocks(model):
                setattr(container, name, Counting(block))


def trained(after: str | None, **device: Any) -> ToyTrainer:
    class Trainer(ToyTrainer):
        if after is not None:
            parallel_parts = with_part(CountingPart(), after=after)

    trainer = Trainer(toy_config(optimizer="sgd", n_samples=48, seed=0,
                                 device_parameters=DeviceParameters(**device)))
    trainer.fit()
    return trainer


def counters(model: nn.Module) -> list[Counting]:
    return [module for module in model.modules() if isinstance(module, Counting)]


@pytest.mark.parametrize(("after", "recomputed"), [("tensor", True),
                                                   ("activation checkpointing", False)])
def test_a_declared_part_acts_at_its_place_in_the_order(after: str, recomputed: bool) -> None:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

    plain = trained(None, checkpoint_activations=True)
    # Wrapping a block in the checkpoint wrapper changes nothing it draws: activation
    # checkpointing starts from (and trains) the weights of the run without it.
    for mine, theirs in zip(plain.model.parameters(), trained(None).model.parameters(),
                            strict=True):
        assert torch.equal(mine, theirs)
    counted = trained(after, checkpoint_activations=True)
    blocks = [block for _, _, block in find_blocks(counted.model)]
    assert len(blocks) == 2
    steps = counted.global_step
    assert steps == 48 // 8
    for block in blocks:
        if recomputed:
            # Before activation checkpointing: checkpointed with the block, so its forward
            # runs again in backward, once per step.
            assert isinstance(block, CheckpointWrapper)
            assert isinstance(block._checkpoint_wrapped_module, Counting)
        else:
            assert isinstance(block, Counting)
            assert isinstance(block.block, CheckpointWrapper)
    assert [counter.calls for counter in counters(counted.model)] == \
        [2 * steps if recomputed else steps] * 2
    # The wrapper computes what the block computes: the same weights as without the part.
    for mine, theirs in zip(counted.model.parameters(), plain.model.parameters(), strict=True):
        assert torch.equal(mine, theirs)


def test_a_part_is_placed_by_name_and_refused_with_the_names() -> None:
    names = [part.name for part in with_part(CountingPart(), after="")]
    assert names[0] == "counting" and names[1:] == [part.name for part in PARTS]
    names = [part.name for part in with_part(CountingPart(), after="data parallel")]
    assert names[-3:] == ["data parallel", "counting", "context"]
    with pytest.raises(ValueError) as error:
        with_part(CountingPart(), after="fsdp")
    assert str(error.value) == (
        "no part named 'fsdp' to place 'counting' after: the parts are ['float8', 'tensor', "
        "'expert', 'activation checkpointing', 'activation offload', 'compile', "
        "'data parallel', 'context'] "
        "(after='' places it first)")
    with pytest.raises(ValueError, match="a part named 'counting' is already in the order"):
        with_part(CountingPart(), after="tensor", parts=with_part(CountingPart(), after=""))


@pytest.mark.parametrize(("device", "ranks", "active"), [
    ({}, 1, []),
    ({"float8_recipe": "rowwise", "checkpoint_activations": True, "compile_model": True}, 1,
     ["float8", "activation checkpointing", "compile"]),
    ({"dp_replicate": 2, "dp_shard": 1}, 2, ["data parallel"]),
    ({"dp_shard": 2, "tensor_parallel": 2, "context_parallel": 2, "expert_parallel": 2}, 8,
     ["tensor", "expert", "data parallel", "context"]),
])
def test_inactive_parts_are_never_run(device: dict[str, Any], ranks: int,
                                      active: list[str]) -> None:
    params = DeviceParameters(**device)
    dims = ParallelDims.resolve(params, ranks)
    assert [part.name for part in PARTS if part.active(params, dims)] == active
