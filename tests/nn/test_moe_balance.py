"""Global-batch balancing (``MoE(aux_loss_scope="global_batch")``): the auxiliary loss weighs
each expert by its load over the whole previous step (every micro-batch on every rank that
holds different tokens), so the step's loss and gradients are those of one process on the
global batch, whatever the layout: one process with and without accumulation, DDP with and
without, ep=2 with and without. The per-call scope, the default, does differ by layout."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from dream_trainer.nn import MoE
from tests.helpers.launch import REPO, check, torchrun
from tests.helpers.moe import DIM, EXPERTS, HIDDEN
from tests.helpers.tolerance import assert_close_to_scale, assert_tensors_close_to_scale
from tests.scripts.moe_balance import run

LAYOUTS = ["ddp", "ddp_accumulated", "ep2", "ep2_accumulated"]


def test_the_loss_weighs_the_previous_steps_load_and_is_uniform_before_it() -> None:
    torch.manual_seed(0)
    layer = MoE(DIM, HIDDEN, EXPERTS, top_k=2, aux_loss_weight=0.1,
                aux_loss_scope="global_batch")
    x = torch.randn(6, DIM)
    layer(x)
    # No step yet: every f_i is 1, and sum_i P_i is 1 (the probabilities of a token sum to 1).
    # Softmax rows that each sum to 1 within an ulp or two, averaged: a few ulps of 0.1.
    assert_close_to_scale(layer.aux_loss, torch.tensor(0.1), ulps=8)
    (grad,) = torch.autograd.grad(layer.aux_loss, layer.router.weight)
    # Zero but for rounding: terms of ~0.014 that cancel (6 ulps of them; 8e-17 measured).
    assert grad.abs().max() < 1e-8
    layer.tokens_per_expert = torch.tensor([9.0, 1.0, 2.0, 0.0])
    layer.update_bias()  # what the step does: keeps the step's load, forgets the counts
    assert layer.global_load.tolist() == [9.0, 1.0, 2.0, 0.0]
    assert layer.tokens_per_expert.sum() == 0
    layer(x)
    scores = layer.router(x).softmax(-1)
    # f_i = num_experts x expert i's share of the step's 12 slots, not this call's loads.
    f = torch.tensor([9.0, 1.0, 2.0, 0.0]) * EXPERTS / 12
    # One positive sum of 4 products, its terms added in another order: a few ulps.
    assert_close_to_scale(layer.aux_loss, 0.1 * (f * scores.mean(0)).sum(), ulps=8)
    assert "global_load" in layer.state_dict()  # checkpointed: a resumed run weighs the same
    assert "global_load" not in MoE(DIM, HIDDEN, EXPERTS, top_k=2).state_dict()
    layer.reset_parameters()
    assert layer.global_load.sum() == 0


def test_an_unknown_scope_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="aux_loss_scope='global' is not 'micro_batch' or "
                                         "'global_batch'"):
        MoE(DIM, HIDDEN, EXPERTS, top_k=2, aux_loss_scope="global")  # type: ignore[arg-type]


def assert_one_process(got: dict[str, Any], one: dict[str, Any], layout: str) -> None:
    assert got["steps"] == one["steps"] == 4, layout
    # The loss (averaged as the trainer averages a mean loss) and every gradient after the
    # reduction: float32 sums in another order, a few ulps of the scale apart. The gradients
    # (summed over micro-batches, then over ranks: up to 7.4 ulps seen on AVX512, AVX2 and
    # ATen's default kernels) are held to the scale of the step's largest, as the head bias's
    # sums probabilities minus targets, terms that cancel to far below their own size.
    assert_close_to_scale(got["aux"], one["aux"], ulps=16, msg=layout)
    for step, (mine, theirs) in enumerate(zip(got["grads"], one["grads"], strict=True)):
        assert_tensors_close_to_scale(mine, theirs, ulps=32, shared_scale=True,
                                      msg=f"{layout}: step {step}")
    for mine, theirs in zip(got["global_loads"], one["global_loads"], strict=True):
        assert torch.equal(mine, theirs), layout  # counts: exact
    for name, weight in one["final"].items():
        assert_close_to_scale(got["final"][name], weight, ulps=16, msg=name)


@pytest.fixture(scope="module")
def one() -> dict[str, Any]:
    result = run("one")
    # Not vacuous: the load moved, the loss left its uniform value, and the balancing
    # gradient reached the router (after the first step, which has no load yet).
    assert result["global_loads"][0].sum() == 0 and result["global_loads"][1].sum() == 16
    assert (result["aux"][1:] - 0.1).abs().max() > 1e-3
    return result


def test_accumulation_weighs_the_load_of_the_whole_step(one: dict[str, Any]) -> None:
    assert_one_process(run("accumulated"), one, "accumulated")


def test_the_per_call_scope_depends_on_the_layout() -> None:
    # What the global scope removes: with each call's own loads, 2 micro-batches of 4 give
    # another loss and other gradients than one batch of 8 (the test above would fail).
    whole, split = run("one", "micro_batch"), run("accumulated", "micro_batch")
    assert (whole["aux"] - split["aux"]).abs().max() > 1e-3
    router = "moe.router.weight"
    assert max((a[router] - b[router]).abs().max()
               for a, b in zip(whole["grads"], split["grads"])) > 1e-3


@pytest.mark.distributed
def test_every_layout_has_one_processs_loss_and_gradients(tmp_path: Any,
                                                          one: dict[str, Any]) -> None:
    out = tmp_path / "balance.pt"
    check(torchrun(REPO / "tests/scripts/moe_balance.py", [str(out), *LAYOUTS]))
    results = torch.load(out)
    for layout in LAYOUTS:
        assert_one_process(results[layout], one, layout)
