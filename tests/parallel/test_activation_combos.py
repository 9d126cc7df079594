"""Activation checkpointing policies and activation offload composed with a pipeline (pp=2),
MoE layers under expert parallelism (ep=2 over dp_shard=2) and float8 (emulated) under FSDP2,
offload under tensor and context parallelism, and the policies under compilation: each setting trains the weights of the same
layout without either, and an MoE layer counts its load once per forward, not again when
checkpointing recomputes it.

Equality: bitwise. Recomputing a block on the CPU replays the same kernels on the same inputs
in the same order (these blocks have no dropout; MoE routing reads the bias that forward read,
since it moves only at the optimizer step), and offloading hands backward a copy of the same
bits; each run is compared with its own layout's run without either, whose reductions run in
the same order.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from dream_trainer.configs import DeviceParameters, TrainingParameters
from dream_trainer.nn import MoE
from dream_trainer.parallel.checkpointing import checkpoint_blocks
from tests.helpers.launch import REPO, check, torchrun
from tests.helpers.rotary_gpt import DIM, GPTConfig, sequences, summed_loss, targets_of
from tests.scripts.activation_combos_run import LAYOUTS, SETTINGS
from tests.scripts.activation_policies_run import BLOCKS, GLOBAL_BATCH, STEPS, PolicyTrainer
from tests.scripts.moe_combos import MoEGPT

SCRIPT = REPO / "tests/scripts/activation_combos_run.py"
RUNS = {layout: (list(SETTINGS) if layout in ("pp2", "ep2", "float8")
                 else ["none", "offload", "full_offload"]) for layout in LAYOUTS}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    out = tmp_path_factory.mktemp("combos") / "runs.pt"
    names = [f"{layout}:{setting}" for layout, settings in RUNS.items() for setting in settings]
    check(torchrun(SCRIPT, [str(out), *names], nproc=2, timeout=600))
    return torch.load(out)


@pytest.mark.distributed
@pytest.mark.parametrize("layout", list(RUNS))
def test_every_setting_trains_the_weights_of_neither(runs: dict[str, dict[str, Any]],
                                                     layout: str) -> None:
    plain = runs[f"{layout}:none"]
    # Every weight of the model, both pipeline stages' included, and the steps moved them.
    expected_count = 43 if layout == "ep2" else 69
    assert len(plain["weights"]) == expected_count
    assert max((plain["weights"][name] - plain["initial"][name]).abs().max()
               for name in plain["weights"]) > 1e-3
    for setting in RUNS[layout]:
        result = runs[f"{layout}:{setting}"]
        assert result["steps"] == 3, setting
        assert result["weights"].keys() == plain["weights"].keys(), setting
        for name, tensor in plain["weights"].items():
            assert torch.equal(result["weights"][name], tensor), (setting, name)


@pytest.mark.distributed
def test_recomputed_moe_layers_count_their_load_once(runs: dict[str, dict[str, Any]]) -> None:
    plain = runs["ep2:none"]
    # Per layer and step, rank 0's 2 accumulated micro-batches of 2 sequences of 16 tokens,
    # top 2: 128 routing slots.
    assert plain["loads"] == [[128.0, 128.0]] * 3
    for setting in RUNS["ep2"]:
        result = runs[f"ep2:{setting}"]
        assert result["loads"] == plain["loads"], setting
        for name, bias in plain["biases"].items():
            assert torch.equal(result["biases"][name], bias), (setting, name)


def moe_load_after_one_step(policy: Any) -> list[torch.Tensor]:
    torch.manual_seed(0)
    model = MoEGPT(2)
    checkpoint_blocks(model, policy)
    tokens = sequences(4, 16, 0)
    summed_loss(model(tokens[:, :-1]), targets_of(tokens)).backward()
    return [layer.tokens_per_expert.clone() for layer in model.modules()
            if isinstance(layer, MoE)]


@pytest.mark.parametrize("policy", ["full", 2, "selective"])
def test_a_recomputed_moe_layer_counts_its_tokens_once_on_one_process(policy: Any) -> None:
    plain = moe_load_after_one_step(None)
    # 4 sequences of 16 tokens, top 2: 128 routing slots per layer.
    assert [float(load.sum()) for load in plain] == [128.0, 128.0]
    assert all(torch.equal(load, expected)
               for load, expected in zip(moe_load_after_one_step(policy), plain, strict=True))


class AnnotatedBlock(nn.Module):
    """A block whose forward annotates with ``record_function`` once more when recomputed
    inside backward, as FSDP2's hooks on a unit inside a checkpointed block may."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch._C._current_graph_task_id() != -1:
            with torch.profiler.record_function("recomputation only"):
                pass
        with torch.profiler.record_function("every forward"):
            return torch.relu(self.linear(x)) * 2


class Annotated(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(AnnotatedBlock() for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def annotated_gradients(policy: Any) -> list[torch.Tensor]:
    torch.manual_seed(0)
    model = Annotated()
    checkpoint_blocks(model, policy)
    model(torch.randn(3, DIM)).square().sum().backward()
    return [param.grad for param in model.parameters()]


def test_op_level_policies_pass_over_annotations_that_differ_in_the_recomputation() -> None:
    plain = annotated_gradients(None)
    for policy in ("selective", "full"):
        assert all(torch.equal(grad, expected)
                   for grad, expected in zip(annotated_gradients(policy), plain, strict=True))


def compiled_run(policy: Any) -> tuple[dict[str, torch.Tensor], list[str]]:
    """3 SGD steps of the rotary GPT with its blocks compiled: the final weights, and what
    each compiled block wraps."""
    trainer = PolicyTrainer(GPTConfig(
        project="combos", group="tests", experiment=f"compiled-{policy}", n_layers=BLOCKS,
        device_parameters=DeviceParameters(compile_model=True, activation_checkpointing=policy),
        training_parameters=TrainingParameters(n_epochs=1, train_batch_size=GLOBAL_BATCH,
                                               max_steps=STEPS)))
    trainer.fit()
    return trainer.weights, [type(block._orig_mod).__name__ for block in trainer.model.layers]


def test_every_policy_trains_the_weights_of_no_checkpointing_when_compiled() -> None:
    """Compilation follows checkpointing in the build order, so each compiled block holds its
    checkpoint wrapper and torch.compile traces the recomputation with it. Bitwise: the
    compiled recomputation runs the same generated kernels on the same inputs."""
    plain, blocks = compiled_run(None)
    assert blocks == ["Block"] * BLOCKS
    wrapped = {"full": [True] * 4, 2: [True, False, True, False], "selective": [True] * 4}
    for policy, checkpointed in wrapped.items():
        weights, blocks = compiled_run(policy)
        assert blocks == ["CheckpointWrapper" if flag else "Block" for flag in checkpointed]
        assert weights.keys() == plain.keys()
        for name, tensor in plain.items():
            assert torch.equal(weights[name], tensor), (policy, name)
