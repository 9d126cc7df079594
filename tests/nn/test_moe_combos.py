"""Expert parallelism composed with tensor, pipeline and context parallelism and with HSDP.

A causal GPT whose blocks end in MoE layers (4 experts, top 2, a shared expert, the
auxiliary-loss-free balancing bias; ``tests/scripts/moe_combos.py``) trains 3 SGD steps of 2
accumulated micro-batches with ``num_items`` and binding clipping. Under ep=2 x tp=2, ep=2 x
pp=2, ep=2 with dp_replicate=2 and ep=2 x cp=2, each on 4 ranks of one launch, the final
weights equal one process's within 1e-6 (~1.5e-8 here) and every layer's bias exactly; the
one-process reference runs in this process.
"""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch
from pydantic import ValidationError

from dream_trainer.configs import DeviceParameters
from dream_trainer.world import ParallelDims
from dream_trainer.world.dims import MeshAxis
from tests.helpers.launch import REPO, check, torchrun
from tests.helpers.tolerance import assert_close_to_scale
from tests.scripts.moe_combos import run

SCRIPT = REPO / "tests/scripts/moe_combos.py"
HELD = {
    # run: (this rank's part of each expert weight, the mesh it is sharded over)
    "ep2_tp2": ((2, 16, 16), ("efsdp", "ep")),  # 2 of the 4 experts; efsdp is 1
    "ep2_pp2": ((2, 16, 16), ("efsdp", "ep")),
    "ep2_hsdp": ((2, 16, 16), ("dp_replicate", "efsdp", "ep")),
    # ep is the 2 cp ranks, efsdp the 2 dp_shard ranks: 2 experts, each half sharded.
    "ep2_cp2": ((1, 16, 16), ("efsdp", "ep")),
}
TOKEN_RANKS = {"ep2_tp2": 2, "ep2_pp2": 2, "ep2_hsdp": 4, "ep2_cp2": 4}
"""Ranks that hold different tokens of a step: dp, times cp (tp ranks hold the same)."""
SLOTS = 2 * 4 * 16 * 2  # micro-batches x sequences x tokens x top_k: one process's step
STAGES = ("ep2_pp2_half", "ep2_pp2_none")
"""ep=2 x pp=2 with an MoE layer in the second block only (the first stage holds none), and
in no block."""


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    from dream_trainer.checkpoint.rng import rng_state, set_rng_state

    out = tmp_path_factory.mktemp("moe_combos") / "combos.pt"
    check(torchrun(SCRIPT, [str(out), *HELD, *STAGES], nproc=4, timeout=400))
    merged: dict[str, Any] = torch.load(out)
    generators = rng_state()
    try:  # in this process: no launch, and the seeding is undone
        merged["one"] = run("one")
        merged["one_half"] = run("one_half")
    finally:
        set_rng_state(generators)
    return merged


@pytest.mark.distributed
@pytest.mark.parametrize("name", list(HELD))
def test_expert_parallel_with_another_degree_trains_as_one_process(
        results: dict[str, Any], name: str) -> None:
    got, expected = results[name], results["one"]
    assert got["held"] == {"shape": HELD[name][0], "mesh": HELD[name][1], "ep_group": True}
    assert got["weights"].keys() == expected["weights"].keys() and expected["weights"]
    for key, tensor in expected["weights"].items():
        # Partial gradients summed over ranks in another order: a few ulps, carried by 3 steps.
        assert_close_to_scale(got["weights"][key], tensor, ulps=16, msg=key)
    for key, tensor in expected["initial"].items():
        assert torch.equal(got["initial"][key], tensor), key
    # Not vacuous: training moved the weights by far more than the tolerance.
    assert max((expected["weights"][key] - expected["initial"][key]).abs().max()
               for key in expected["weights"]) > 1e-3
    # Each rank counts its share of the step's routing slots, from the step's own
    # micro-batches only (a pipeline's shape-inference pass adds a microbatch's if counted;
    # rank 0 holds the first pipeline stage's layer only) ...
    layers = 1 if name == "ep2_pp2" else 2
    assert expected["loads"] == [[SLOTS] * 2] * 3
    assert got["loads"] == [[SLOTS / TOKEN_RANKS[name]] * layers] * 3
    # ... and each layer's bias moved by the load of every rank that holds different tokens.
    assert got["biases"].keys() == expected["biases"].keys() == {
        "layers.0.moe.expert_bias", "layers.1.moe.expert_bias"}
    for key, bias in expected["biases"].items():
        assert bias.abs().sum() > 0, key
        assert torch.equal(got["biases"][key], bias), key
    # Clipping bound every step, with the whole model's norm (experts counted once).
    assert min(expected["grad_norms"]) > 0.3
    torch.testing.assert_close(got["grad_norms"], expected["grad_norms"], rtol=1e-5, atol=0)


@pytest.mark.distributed
def test_a_pipeline_stage_without_moe_layers_trains_and_none_anywhere_is_refused_alike(
        results: dict[str, Any]) -> None:
    got, expected = results["ep2_pp2_half"], results["one_half"]
    assert got["weights"].keys() == expected["weights"].keys()
    for key, tensor in expected["weights"].items():
        # As in the runs above: partial gradients summed in another order, over 3 steps.
        assert_close_to_scale(got["weights"][key], tensor, ulps=16, msg=key)
    assert got["biases"].keys() == {"layers.1.moe.expert_bias"}
    assert torch.equal(got["biases"]["layers.1.moe.expert_bias"],
                       expected["biases"]["layers.1.moe.expert_bias"])
    # Rank 0 runs the first stage (no MoE layer), so records no layout of experts; the last
    # stage's layer moved its bias, so the step counted its load.
    assert got["held"] is None
    assert expected["biases"]["layers.1.moe.expert_bias"].abs().sum() > 0
    # Every rank of both stages raised the same refusal (before, one stage named the missing
    # layer and the other failed with "Connection closed").
    assert results["ep2_pp2_none"]["errors"] == [
        "expert_parallel=2 but no model (no stage of a pipeline) has a dream_trainer.nn.MoE "
        "layer: set expert_parallel=1, convert your MoE modules to MoE layers "
        "(replace_hf_moe_blocks, replace_torchtitan_moe_blocks), or override "
        "MoEGPTTrainer.apply_expert_parallel(ep_mesh) for your own mixture-of-experts "
        "module"] * 4


@pytest.mark.parametrize(("fields", "world_size", "axes", "efsdp"), [
    # tp and pp ranks and replicas each hold all the experts of their ep group.
    ({"dp_shard": 2, "tensor_parallel": 2}, 4,
     [(MeshAxis.EFSDP, 1), (MeshAxis.EP, 2), (MeshAxis.TP, 2)], 1),
    ({"dp_shard": 2, "pipeline_parallel": 2}, 4,
     [(MeshAxis.PP, 2), (MeshAxis.EFSDP, 1), (MeshAxis.EP, 2)], 1),
    ({"dp_shard": 2, "dp_replicate": 2}, 4,
     [(MeshAxis.DP_REPLICATE, 2), (MeshAxis.EFSDP, 1), (MeshAxis.EP, 2)], 1),
    # ep borrows every cp rank: with ep = cp, all of dp_shard is left to efsdp ...
    ({"dp_shard": 2, "context_parallel": 2}, 4, [(MeshAxis.EFSDP, 2), (MeshAxis.CP, 2)], 2),
    # ... and beyond cp, ep / cp of the dp_shard ranks.
    ({"expert_parallel": 4, "dp_shard": 4, "context_parallel": 2}, 8,
     [(MeshAxis.EFSDP, 2), (MeshAxis.DP_SHARD_IN_EP, 2), (MeshAxis.CP, 2)], 2),
])
def test_expert_parallel_borrows_from_dp_shard_and_every_cp_rank(
        fields: dict[str, Any], world_size: int, axes: list[tuple[MeshAxis, int]],
        efsdp: int) -> None:
    dims = ParallelDims.resolve(DeviceParameters(**{"expert_parallel": 2, **fields}),
                                world_size)
    assert dims.mesh_axes() == axes and dims.efsdp == efsdp
    assert dims.world_size == world_size


@pytest.mark.parametrize(("fields", "message"), [
    ({"expert_parallel": 2, "dp_shard": 2, "context_parallel": 4},
     "expert_parallel=2 with context_parallel=4: expert parallelism borrows every "
     "context-parallel rank (they hold different tokens) and the rest from dp_shard, so "
     "expert_parallel must be a multiple of 4: set it to one, or change context_parallel"),
    ({"expert_parallel": 4, "dp_shard": 3, "context_parallel": 2},
     "expert_parallel=4 borrows its ranks from dp_shard (and context_parallel=2), so dp_shard "
     "must be a multiple of 2, got dp_shard=3: set dp_shard to a multiple of 2 or 'auto'"),
])
def test_what_expert_parallelism_cannot_borrow_is_refused_naming_the_fields(
        fields: dict[str, Any], message: str) -> None:
    with pytest.raises(ValidationError, match=re.escape(message)):
        DeviceParameters(**fields)
