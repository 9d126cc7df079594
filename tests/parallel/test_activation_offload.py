"""Activation offloading (``DeviceParameters.activation_offload``): it trains the weights of
the run without it, on one process and on FSDP2, alone and under checkpointing policies; its
hooks pack copies, not the originals, and count what they moved; the combinations it cannot
serve are refused naming the field.

Equality: every comparison of weights is bitwise. Offloading copies a saved tensor and hands
the copy to backward: the same bits, so backward runs the same kernels on the same values
in the same order as the run without it.
"""

from __future__ import annotations

import gc
import json
import re
from typing import Any

import pytest
import torch
from pydantic import ValidationError
from torch.multiprocessing.reductions import StorageWeakRef

from dream_trainer.configs import DeviceParameters
from dream_trainer.parallel.checkpointing import checkpoint_blocks
from dream_trainer.parallel.names import clean_name
from dream_trainer.parallel.offload import (ActivationOffload, OffloadStats, OffloadWrapper,
                                            offload_blocks, offload_stats)
from dream_trainer.parallel.parts import PARTS, OffloadPart
from dream_trainer.world import ParallelDims
from tests.helpers.launch import REPO, check, torchrun
from tests.helpers.rotary_gpt import RotaryGPT, sequences, summed_loss, targets_of
from tests.helpers.saved_activations import saved_activation_bytes
from tests.scripts.activation_offload_run import RUNS, run
from tests.scripts.activation_policies_run import BLOCKS, STEPS, keep_attention

SCRIPT = REPO / "tests/scripts/activation_offload_run.py"
PERFORMANCE = REPO / "docs/performance.md"


@pytest.fixture(scope="module")
def one() -> dict[str, dict[str, Any]]:
    return {name: run("one", name) for name in RUNS}


@pytest.fixture(scope="module")
def two(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, str], dict[str, Any]]:
    out = tmp_path_factory.mktemp("offload") / "two.pt"
    check(torchrun(SCRIPT, [str(out), "fsdp2"], nproc=2, timeout=400))
    return torch.load(out)


def assert_offload_trains_as_without(runs: dict[str, dict[str, Any]], prefix: str) -> None:
    for policy, inner in (("none", "Block"), ("full", "CheckpointWrapper"),
                          ("every_2nd", None)):
        plain, offloaded = runs[policy], runs[f"{policy}_offload" if policy != "none"
                                              else "offload"]
        assert plain["steps"] == offloaded["steps"] == STEPS
        assert plain["stats"] == OffloadStats().__dict__  # nothing offloads unasked
        # Every block is offloaded, checkpointed or not (every 2nd: blocks 0 and 2).
        inners = [inner] * BLOCKS if inner else ["CheckpointWrapper", "Block"] * (BLOCKS // 2)
        assert offloaded["blocks"] == [(prefix + "OffloadWrapper", name) for name in inners]
        stats = offloaded["stats"]
        assert stats["offloaded_bytes"] > 0 and stats["restored_bytes"] >= \
            stats["offloaded_bytes"]
        assert offloaded["weights"].keys() == plain["weights"].keys()
        for name, tensor in plain["weights"].items():
            assert torch.equal(offloaded["weights"][name], tensor), (policy, name)
    # Under full recomputation only the blocks' inputs are kept, all offloaded.
    full = runs["full_offload"]["stats"]
    assert full["kept_bytes"] == 0 and full["offloaded_bytes"] < \
        runs["offload"]["stats"]["offloaded_bytes"]
    # Not vacuous: the steps moved the weights.
    assert (runs["none"]["weights"]["head.weight"]
            - runs["none"]["initial"]["head.weight"]).abs().max() > 1e-3


def test_offloading_trains_the_weights_of_the_run_without_it(
        one: dict[str, dict[str, Any]]) -> None:
    assert_offload_trains_as_without(one, prefix="")


@pytest.mark.distributed
def test_offloading_trains_the_weights_of_the_run_without_it_on_fsdp2(
        two: dict[tuple[str, str], dict[str, Any]]) -> None:
    assert_offload_trains_as_without({name: two[("fsdp2", name)] for name in RUNS},
                                     prefix="FSDP")


def measured(policy: Any, offload: bool) -> tuple[Any, OffloadStats, list[torch.Tensor]]:
    """One step of the rotary GPT: what the saved-tensor helper sees of its forward, the
    offload counts after backward, and the gradients."""
    torch.manual_seed(0)
    model = RotaryGPT(BLOCKS)
    checkpoint_blocks(model, policy)
    if offload:
        assert offload_blocks(model) == BLOCKS
    tokens = sequences(2, 16, 0)
    saved, loss = saved_activation_bytes(
        lambda: summed_loss(model(tokens[:, :-1]), targets_of(tokens)),
        [*model.parameters(), *model.buffers()])
    loss.backward()
    return saved, offload_stats(model), [param.grad for param in model.parameters()]


MEASURED = {"none": None, "every_2nd": 2, "full": "full"}


@pytest.fixture(scope="module")
def measurements() -> dict[str, tuple[Any, ...]]:
    """Per policy: the step without offloading, then with it (``measured``)."""
    return {name: (*measured(policy, offload=False), *measured(policy, offload=True))
            for name, policy in MEASURED.items()}


@pytest.mark.parametrize("policy", list(MEASURED))
def test_the_hooks_account_for_every_byte_they_took_from_the_device(
        measurements: dict[str, tuple[Any, ...]], policy: str) -> None:
    plain, _, plain_grads, saved, stats, grads = measurements[policy]
    # The blocks' own hooks replace the outer ones: what the outer hooks no longer see is
    # exactly what the blocks offloaded (the embedding and head stay outside every block).
    assert stats.offloaded_bytes > 0
    assert plain.hooks - saved.hooks == stats.offloaded_bytes
    # On the CPU the host is the device: each original freed, its copy held instead.
    assert saved.held == plain.held
    # Backward unpacked each copy at least once (a tensor saved twice is copied once).
    assert stats.restored_bytes >= stats.offloaded_bytes
    assert stats.packed_bytes == stats.kept_bytes + stats.restored_bytes
    assert all(torch.equal(mine, theirs) for mine, theirs in zip(grads, plain_grads,
                                                                 strict=True))


def test_the_docs_state_the_offloaded_bytes(measurements: dict[str, tuple[Any, ...]]) -> None:
    section = PERFORMANCE.read_text().split("### Activation offloading", 1)[1]
    section = section.split("\n### ", 1)[0]  # this subsection's table only
    rows = re.findall(r"^\| `([^`]+)`[^|]* \| ([\d,]+) \| ([\d,]+) \|$", section,
                      re.MULTILINE)
    documented = {value: (int(offloaded.replace(",", "")), int(left.replace(",", "")))
                  for value, offloaded, left in rows}
    assert documented == {repr(MEASURED[name]).replace("'", '"'): (stats.offloaded_bytes,
                                                                   saved.hooks)
                          for name, (_, _, _, saved, stats, _) in measurements.items()}


def test_a_saved_activation_is_packed_as_a_copy_and_the_original_freed() -> None:
    weight = torch.randn(8, requires_grad=True)
    offload = ActivationOffload()
    hidden = weight * 2
    original = StorageWeakRef(hidden.untyped_storage())
    with offload:
        # sin saves hidden; mul saves sin's output and weight; sum saves nothing.
        out = (hidden.sin() * weight).sum()
    del hidden
    gc.collect()
    # Autograd holds the host copy, not the activation: its storage is gone.
    assert original.expired()
    # hidden and sin's output copied (8 float32 each), the parameter weight kept.
    assert offload.stats == OffloadStats(packed_bytes=3 * 32, offloaded_bytes=64,
                                         kept_bytes=32, restored_bytes=0)
    out.backward()
    assert torch.equal(weight.grad, (weight * 2).sin() + 2 * (weight * 2).cos() * weight)
    assert offload.stats.restored_bytes == 64
    # Without the hooks autograd keeps the original alive.
    hidden = weight.detach().requires_grad_() * 2
    original = StorageWeakRef(hidden.untyped_storage())
    out = hidden.sin().sum()
    del hidden
    gc.collect()
    assert not original.expired()
    del out


def test_the_part_wraps_every_block_after_checkpointing() -> None:
    names = [part.name for part in PARTS]
    assert names.index("activation offload") == names.index("activation checkpointing") + 1
    params = DeviceParameters(activation_offload=True, activation_checkpointing=2)
    dims = ParallelDims.resolve(params, 1)
    part = OffloadPart()
    assert part.active(params, dims) and not part.active(DeviceParameters(), dims)
    assert part.describe(params, dims) == \
        "saved activations offloaded to host memory, block by block"
    assert part.settings(params, dims) == {"activation_offload": True}
    model = RotaryGPT(3)
    checkpoint_blocks(model, 2)
    assert offload_blocks(model) == 3
    assert all(isinstance(block, OffloadWrapper) for block in model.layers)
    # Checkpoints and the project's names drop the wrapper segments, as for the checkpoint
    # wrapper: layer 0 is wrapped twice.
    assert "layers.0.norm1.weight" in model.state_dict()
    names = [name for name, _ in model.named_parameters()]
    assert "layers.0._checkpoint_wrapped_module._checkpoint_wrapped_module.norm1.weight" in names
    assert [clean_name(name) for name in names] == \
        [name for name, _ in RotaryGPT(3).named_parameters()]


def test_offload_dumps_to_json() -> None:
    params = DeviceParameters(activation_offload=True, activation_checkpointing="full")
    assert json.loads(params.model_dump_json())["activation_offload"] is True
    assert DeviceParameters.model_validate_json(params.model_dump_json()) == params
    assert DeviceParameters().activation_offload is False


@pytest.mark.parametrize(("device", "message"), [
    ({"activation_checkpointing": "selective"},
     "activation_offload=True cannot move what activation_checkpointing='selective' keeps (an "
     "op-level policy caches the outputs it saves outside the saved-tensor hooks): use "
     "activation_checkpointing='full' or an int N, or turn activation_offload off"),
    ({"activation_checkpointing": keep_attention},
     "activation_offload=True cannot move what activation_checkpointing="
     "'tests.scripts.activation_policies_run.keep_attention' keeps (an op-level policy caches "
     "the outputs it saves outside the saved-tensor hooks): use "
     "activation_checkpointing='full' or an int N, or turn activation_offload off"),
    ({"compile_model": True},
     "activation_offload=True with compile_model=True is not supported (torch.compile would "
     "trace the saved-tensor hooks around each block, which is not verified): turn one of "
     "them off"),
])
def test_an_unsupported_combination_is_refused_naming_the_field(device: dict[str, Any],
                                                                message: str) -> None:
    with pytest.raises(ValidationError) as error:
        DeviceParameters(activation_offload=True, **device)
    (problem,) = error.value.errors()
    assert problem["msg"] == f"Value error, {message}"
    # Each alone is fine.
    DeviceParameters(**device)


def test_a_non_boolean_offload_is_refused_naming_the_field() -> None:
    with pytest.raises(ValidationError) as error:
        DeviceParameters(activation_offload="sometimes")
    (problem,) = error.value.errors()
    assert problem["loc"] == ("activation_offload",)
