"""Grouped experts: in bfloat16 the experts run as grouped matrix products
(``torch.nn.functional.grouped_mm``) over rows padded per expert, and give exactly what the loop
of one matrix product per expert gives, forward and backward, whatever the routing leaves
empty; float32 keeps the loop. Under expert parallelism (ep=2, ep=2 x efsdp=2) bf16 runs with
grouped experts train as one process does."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from dream_trainer.nn import GroupedExperts, MoE
from dream_trainer.nn.moe import _padded_groups, grouped_mm_alignment
from tests.helpers.launch import REPO, check, torchrun

WIDTH, HIDDEN, EXPERTS = 16, 32, 4  # multiples of 8: bf16 rows of 16 bytes


def only_expert(layer: MoE, expert: int) -> None:
    """A router whose scores rank ``expert`` first, then 0, 1, ... for positive features."""
    with torch.no_grad():
        layer.router.weight.zero_()
        layer.router.weight[:, 0] = torch.arange(EXPERTS, 0, -1, dtype=torch.float)
        layer.router.weight[expert, 0] = 50.0


def first_two(layer: MoE, expert: int) -> None:
    """A router that sends every token to experts 0 and 2 only (1 and 3 stay empty)."""
    with torch.no_grad():
        layer.router.weight.zero_()
        layer.router.weight[2, 0], layer.router.weight[0, 0] = 50.0, 25.0


def run(layer: MoE, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The layer's output and the gradients of a fixed projection of it: the tokens', the
    experts' and the router's."""
    tokens = x.clone().requires_grad_(True)
    out = layer(tokens)
    probe = torch.linspace(-1, 1, out.numel()).reshape(out.shape).to(out.dtype)
    grads = torch.autograd.grad((out * probe).sum(), [tokens, layer.experts.w1,
                                                      layer.experts.w2, layer.experts.w3,
                                                      layer.router.weight])
    return (out, *grads)


@pytest.mark.parametrize(("router", "top_k", "loads"), [
    (None, 2, None),  # a random router
    (first_two, 2, [24.0, 0.0, 24.0, 0.0]),  # two experts empty
    (lambda layer, _: only_expert(layer, 3), 1, [0.0, 0.0, 0.0, 24.0]),  # all to one
])
def test_grouped_experts_equal_the_loop_in_bf16_forward_and_backward(
        monkeypatch: pytest.MonkeyPatch, router: Callable[[MoE, int], None] | None,
        top_k: int, loads: list[float] | None) -> None:
    torch.manual_seed(0)
    layer = MoE(WIDTH, HIDDEN, EXPERTS, top_k=top_k).to(torch.bfloat16)
    if router is not None:
        router(layer, 0)
    x = (torch.randn(4, 6, WIDTH).abs() + 0.5).to(torch.bfloat16)  # feature 0 positive
    calls: list[int] = []
    grouped_mm = F.grouped_mm

    def counted(*args: Any, **kwargs: Any) -> torch.Tensor:
        calls.append(1)
        return grouped_mm(*args, **kwargs)

    monkeypatch.setattr(F, "grouped_mm", counted)
    grouped = run(layer, x)
    assert len(calls) == 3  # w1, w3, w2: the grouped path ran, once per matrix
    if loads is not None:
        assert layer.tokens_per_expert.tolist() == loads
    layer.experts.use_grouped_mm = False
    looped = run(layer, x)
    assert len(calls) == 3  # ... and the loop did not call it
    # Exact: on the CPU torch computes each group with the matrix product the loop calls, on
    # the same rows in the same order; the padding rows are zeros appended to each group,
    # which leave every other row's output alone and add exact zeros at the end of the
    # weight gradients' sums over rows.
    for name, a, b in zip(["out", "tokens", "w1", "w2", "w3", "router"], grouped, looped):
        assert a.abs().sum() > 0, name
        assert torch.equal(a, b), name
    if loads is not None:  # the experts without tokens get zero gradients, not none
        empty = [expert for expert, load in enumerate(loads) if load == 0]
        for grad in grouped[2:5]:
            assert grad[empty].abs().sum() == 0


def test_the_grouped_path_is_chosen_by_dtype_and_width() -> None:
    weight = torch.empty(EXPERTS, WIDTH, HIDDEN)
    tokens = torch.empty(5, WIDTH)
    for dtype in (torch.bfloat16, torch.float16):
        assert grouped_mm_alignment(tokens.to(dtype), weight.to(dtype)) == 8  # 16 bytes
    assert grouped_mm_alignment(tokens, weight) is None  # float32: the loop
    assert grouped_mm_alignment(tokens.bfloat16(), weight) is None  # mixed dtypes
    # A width that is not a multiple of 16 bytes: torch's kernels refuse its strides.
    assert grouped_mm_alignment(torch.empty(5, 12, dtype=torch.bfloat16),
                                torch.empty(EXPERTS, 12, HIDDEN, dtype=torch.bfloat16)) is None
    assert grouped_mm_alignment(tokens.bfloat16(),
                                torch.empty(EXPERTS, WIDTH, 20, dtype=torch.bfloat16)) is None


def test_each_experts_rows_are_padded_to_a_whole_block_and_empty_ones_get_one() -> None:
    rows, offsets, total = _padded_groups([3, 0, 9, 2], 8, torch.device("cpu"))
    assert rows.tolist() == [0, 1, 2, *range(16, 25), 32, 33]
    assert offsets.dtype == torch.int32 and offsets.tolist() == [8, 16, 32, 40]
    assert total == 40


def test_float32_runs_the_loop_and_equals_a_hand_computation(
        monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: Any, **kwargs: Any) -> torch.Tensor:
        raise AssertionError("float32 must not call grouped_mm")

    monkeypatch.setattr(F, "grouped_mm", refuse)
    torch.manual_seed(0)
    experts = GroupedExperts(WIDTH, HIDDEN, EXPERTS)
    tokens = torch.randn(7, WIDTH)
    out = experts(tokens, [2, 0, 5, 0])
    expected = torch.cat([(F.silu(rows @ experts.w1[e]) * (rows @ experts.w3[e])) @ experts.w2[e]
                          for e, rows in ((0, tokens[:2]), (2, tokens[2:]))])
    assert torch.equal(out, expected)


def bf16_ulps(got: torch.Tensor, expected: torch.Tensor) -> torch.Tensor:
    """``|got - expected|`` in units of bf16's spacing at ``expected`` (floored at 2^-6, so
    that numbers near zero are not measured in vanishing units)."""
    magnitude = expected.float().abs().clamp_min(2.0 ** -6)
    return (got.float() - expected.float()).abs() / torch.exp2(magnitude.log2().floor() - 7)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """bf16 runs under ep=2 (2 ranks) and ep=2 x efsdp=2 (4 ranks)."""
    out = tmp_path_factory.mktemp("grouped")
    script = REPO / "tests/scripts/moe_ranks.py"
    check(torchrun(script, [str(out / "two.pt"), "ep2_bf16"]))
    check(torchrun(script, [str(out / "four.pt"), "ep2_efsdp2_bf16"], nproc=4))
    return {**torch.load(out / "two.pt"), **torch.load(out / "four.pt")}


@pytest.fixture(scope="module")
def single() -> dict[str, Any]:
    from tests.scripts.moe_ranks import run as run_mode

    return run_mode("one_bf16")


@pytest.mark.distributed
@pytest.mark.parametrize("mode", ["ep2_bf16", "ep2_efsdp2_bf16"])
def test_expert_parallel_bf16_with_grouped_experts_equals_one_process(
        ranks: dict[str, Any], single: dict[str, Any], mode: str) -> None:
    got = ranks[mode]
    assert got["steps"] == single["steps"] == 4
    assert got["grouped_calls"] > 0 and single["grouped_calls"] > 0
    assert got["held"]["mesh"] == ("efsdp", "ep")
    assert got["final"].keys() == single["final"].keys()
    differing = total = 0
    moved = 0.0
    for name, tensor in single["final"].items():
        assert tensor.dtype == torch.bfloat16, name
        ulps = bf16_ulps(got["final"][name], tensor)
        # The float32 tests' 1e-6 is ~8 float32 ulps at 1: here 8 bf16 ulps. The same rows
        # meet the same experts in the same order on every layout; what differs is where the
        # dense gradients are summed in bf16 (one product over the batch, or one per rank then
        # a reduction), a rounding apart, which later steps carry on. Measured: at most 2 ulps
        # (ep2) and 1 (ep2 x efsdp2), in 7 and 36 of the 3,237 numbers; the rest bit-equal.
        assert ulps.max() <= 8, (name, float(ulps.max()))
        differing, total = differing + int((ulps > 0).sum()), total + ulps.numel()
        if name in single["initial"]:
            moved = max(moved, float(bf16_ulps(tensor, single["initial"][name]).max()))
    assert differing <= total // 50, differing
    assert moved > 50  # training moved the weights by far more than the bound
    assert torch.equal(got["final"]["moe.expert_bias"], single["final"]["moe.expert_bias"])
