"""The MoE layer in one process: the routed output equals a token-by-token computation,
every token reaches all of its top-k experts (none dropped), and the auxiliary loss and the
balancing bias equal hand computations; in a trainer the bias moves once per optimizer step by
the load of the whole step."""

from __future__ import annotations

import io
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from dream_trainer.nn import MoE
from tests.helpers.launch import REPO, check, torchrun
from tests.helpers.moe import DIM, EXPERTS, HIDDEN, MoETrainer, moe_config
from tests.helpers.tolerance import assert_close_to_scale


def expert(layer: MoE, index: int, x: torch.Tensor) -> torch.Tensor:
    w1, w2, w3 = (getattr(layer.experts, name)[index] for name in ("w1", "w2", "w3"))
    return (F.silu(x @ w1) * (x @ w3)) @ w2


def token_by_token(layer: MoE, x: torch.Tensor) -> torch.Tensor:
    """Each token on its own: its scores, its top-k experts, their weighted sum."""
    out = []
    for token in x.reshape(-1, DIM):
        logits = layer.router(token).float()
        scores = logits.softmax(-1) if layer.score_func == "softmax" else logits.sigmoid()
        bias = layer.expert_bias if layer.bias_update_rate is not None else 0
        chosen = (scores + bias).topk(layer.top_k).indices
        weights = scores[chosen]
        if layer.normalize_scores:
            weights = weights / weights.sum()
        value = sum(w * expert(layer, int(e), token) for w, e in zip(weights, chosen))
        if layer.shared_experts is not None:
            value = value + layer.shared_experts(token)
        out.append(value)
    return torch.stack(out).reshape(x.shape)


@pytest.mark.parametrize("options", [
    {"top_k": 1},
    {"top_k": 2, "normalize_scores": True},
    {"top_k": 3, "score_func": "sigmoid", "num_shared_experts": 1},
    {"top_k": 2, "score_func": "sigmoid", "normalize_scores": True, "bias_update_rate": 0.1},
])
def test_output_equals_the_token_by_token_computation(options: dict[str, Any]) -> None:
    torch.manual_seed(0)
    layer = MoE(DIM, HIDDEN, EXPERTS, **options)
    if layer.bias_update_rate is not None:
        layer.expert_bias.copy_(torch.tensor([0.3, -0.2, 0.0, 0.1]))  # changes the choices
    x = torch.randn(3, 5, DIM)
    # Sums of a few float32 products in another order (one matmul per expert against one
    # product per token), a few ulps of the outputs' scale apart.
    assert_close_to_scale(layer(x), token_by_token(layer, x), ulps=16)


def test_every_token_reaches_its_experts_even_when_all_choose_the_same() -> None:
    # A router that gives expert 2 by far the highest score and expert 0 the second: with
    # top_k=2 all 15 tokens go to both (no capacity limit), experts 1 and 3 get none.
    torch.manual_seed(0)
    layer = MoE(DIM, HIDDEN, EXPERTS, top_k=2)
    with torch.no_grad():
        layer.router.weight.zero_()
        layer.router.weight[2, 0], layer.router.weight[0, 0] = 50.0, 25.0
    x = torch.randn(15, DIM).abs() + 0.5  # feature 0 positive: the order holds for all
    out = layer(x)
    assert layer.tokens_per_expert.tolist() == [15.0, 0.0, 15.0, 0.0]
    scores = layer.router(x).softmax(-1)
    expected = scores[:, 2:3] * expert(layer, 2, x) + scores[:, 0:1] * expert(layer, 0, x)
    assert_close_to_scale(out, expected, ulps=16)  # as above: products in another order
    assert layer.experts.w1.grad is None
    out.sum().backward()
    # Only the experts that received tokens get gradients.
    grads = layer.experts.w1.grad.abs().sum(dim=(1, 2))
    assert grads[0] > 0 and grads[2] > 0 and grads[1] == 0 and grads[3] == 0


def test_the_auxiliary_loss_is_deepseeks_formula() -> None:
    torch.manual_seed(0)
    layer = MoE(DIM, HIDDEN, EXPERTS, top_k=2, aux_loss_weight=0.01)
    x = torch.randn(6, DIM)
    layer(x)
    scores = layer.router(x).softmax(-1)
    chosen = scores.topk(2).indices
    # f_i: expert i's share of the 6 x 2 routing slots, times 4 experts / 2 per token.
    f = torch.tensor([float((chosen == i).sum()) for i in range(EXPERTS)]) * EXPERTS / (2 * 6)
    p = scores.mean(dim=0)
    # One positive sum of 4 products, its terms added in another order: a few ulps.
    assert_close_to_scale(layer.aux_loss, 0.01 * (f * p).sum(), ulps=8)
    # A uniform router (all scores equal) loads every expert equally: f_i = 1, P_i = 1/4.
    with torch.no_grad():
        layer.router.weight.zero_()
    layer(x)
    # f_i = 1 and P_i = 1/4 but for the softmax's rounding: a few ulps of 0.01.
    assert_close_to_scale(layer.aux_loss, torch.tensor(0.01), ulps=8)
    # It has a gradient through the scores, none through the counts.
    layer.router.weight.requires_grad_(True)
    layer(torch.randn(6, DIM)).sum()
    (grad,) = torch.autograd.grad(layer.aux_loss, layer.router.weight)
    assert grad.abs().sum() > 0


def test_the_bias_moves_towards_the_under_loaded_experts_and_only_chooses() -> None:
    layer = MoE(DIM, HIDDEN, EXPERTS, top_k=1, bias_update_rate=0.05)
    layer.tokens_per_expert = torch.tensor([10.0, 2.0, 4.0, 0.0])  # mean 4
    layer.update_bias()
    assert layer.expert_bias.tolist() == pytest.approx([-0.05, 0.05, 0.0, 0.05])
    assert layer.tokens_per_expert.tolist() == [0.0] * 4
    # A bias large enough picks expert 3 for every token, but the weight is the score alone.
    layer.expert_bias.copy_(torch.tensor([0.0, 0.0, 0.0, 10.0]))
    x = torch.randn(7, DIM)
    out = layer(x)
    assert layer.tokens_per_expert.tolist() == [0.0, 0.0, 0.0, 7.0]
    scores = layer.router(x).softmax(-1)
    # One expert's batched product against the same product written out: a few ulps.
    assert_close_to_scale(out, scores[:, 3:4] * expert(layer, 3, x), ulps=16)
    assert "expert_bias" in layer.state_dict()
    assert "expert_bias" not in MoE(DIM, HIDDEN, EXPERTS, top_k=1).state_dict()


def test_a_pass_outside_the_batch_routes_but_is_not_counted() -> None:
    from dream_trainer.nn.moe import uncounted_load

    layer = MoE(DIM, HIDDEN, EXPERTS, top_k=2, bias_update_rate=0.05)
    x = torch.randn(5, DIM)
    with uncounted_load():
        inside = layer(x)
    assert layer.tokens_per_expert.sum() == 0
    torch.testing.assert_close(inside, layer(x), rtol=0, atol=0)
    assert layer.tokens_per_expert.sum() == 5 * 2  # counted once the block exits


@pytest.mark.parametrize(("top_k", "score_func"), [(0, "softmax"), (5, "softmax"),
                                                   (1, "relu")])
def test_bad_arguments_are_named(top_k: int, score_func: str) -> None:
    with pytest.raises(ValueError, match="top_k=|score_func="):
        MoE(DIM, HIDDEN, EXPERTS, top_k=top_k, score_func=score_func)  # type: ignore[arg-type]


def run(batch: int, accumulation: int) -> MoETrainer:
    trainer = MoETrainer(moe_config(batch, accumulation))
    trainer.fit()
    return trainer


def test_a_step_moves_the_bias_by_the_load_of_all_its_micro_batches() -> None:
    accumulated, whole = run(batch=4, accumulation=2), run(batch=8, accumulation=1)
    assert whole.global_step == accumulated.global_step == 4
    for step, (load, bias) in enumerate(zip(accumulated.loads, accumulated.biases)):
        assert load.sum() == 8 * 2  # both micro-batches' tokens, 2 slots each
        after = accumulated.biases[step + 1] if step + 1 < 4 \
            else accumulated.moe().expert_bias
        torch.testing.assert_close(after, bias + 0.01 * torch.sign(load.mean() - load))
    # The same update as one batch of the whole step: the same loads, biases and weights.
    for mine, theirs in zip(accumulated.loads, whole.loads):
        assert torch.equal(mine, theirs)
    assert torch.equal(accumulated.moe().expert_bias, whole.moe().expert_bias)
    for (name, a), (_, b) in zip(accumulated.model.named_parameters(),
                                 whole.model.named_parameters()):
        # Two half-batch means averaged against one mean: float32 rounding only, a few ulps
        # of the gradients carried into weights of scale ~1 by 4 steps.
        assert_close_to_scale(a, b, ulps=16, msg=name)
    assert accumulated.moe().tokens_per_expert.sum() == 0  # reset by the last step


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Every multi-rank mode: one 2-rank and one 4-rank launch."""
    out = tmp_path_factory.mktemp("moe")
    script = REPO / "tests/scripts/moe_ranks.py"
    check(torchrun(script, [str(out / "two.pt"), "ddp", "fsdp", "ep2", "ep2_items", "ep_error"]))
    check(torchrun(script, [str(out / "four.pt"), "ep2_efsdp2"], nproc=4))
    return {**torch.load(out / "two.pt"), **torch.load(out / "four.pt")}


@pytest.fixture(scope="module")
def single() -> MoETrainer:
    return run(batch=8, accumulation=1)


def assert_one_process(result: dict[str, Any], single: MoETrainer, mode: str) -> None:
    assert result["steps"] == 4, mode
    # The norm of the whole gradient: expert and dense weights, each counted once.
    # One square root of sums over every gradient, added in another order: a few ulps.
    assert_close_to_scale(result["grad_norms"], single.grad_norms, ulps=16,
                          dtype=torch.float32, msg=mode)
    assert torch.equal(result["final"]["moe.expert_bias"], single.moe().expert_bias), mode
    for name, tensor in single.model.named_parameters():
        # Gradients averaged over ranks (and micro-batches) in another order than one mean:
        # float32 rounding only, ~1e-8 after 4 SGD steps, well under 1 ulp of the scale.
        assert_close_to_scale(result["final"][name], tensor, ulps=16, msg=f"{mode}: {name}")


@pytest.mark.distributed
@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_data_parallel_balances_by_the_global_load_and_equals_one_process(
        ranks: dict[str, Any], single: MoETrainer, mode: str) -> None:
    # DDP with 2 accumulated micro-batches and FSDP2, 2 ranks, 8 samples per step in all: the
    # bias moves by the load of every micro-batch on both ranks (a rank's own load gives
    # other signs), so bias and weights equal one process on the same 8 samples.
    assert all(load.sum() == 8 for load in ranks[mode]["loads"])  # this rank's half
    assert_one_process(ranks[mode], single, mode)
    assert single.moe().expert_bias.abs().sum() > 0  # the bias did move


@pytest.mark.distributed
@pytest.mark.parametrize(("mode", "held"), [("ep2", (2, 8, 12)), ("ep2_items", (2, 8, 12)),
                                            ("ep2_efsdp2", (1, 8, 12))])
def test_expert_parallel_equals_one_process(ranks: dict[str, Any], single: MoETrainer,
                                            mode: str, held: tuple[int, ...]) -> None:
    # ep=2 on 2 ranks (each holds 2 of the 4 experts; dense weights FSDP2 over both), the same
    # with 2 accumulated micro-batches and a summed loss with num_items, and ep=2 x efsdp=2 on
    # 4 ranks (each half of the experts FSDP2-sharded over 2 ranks): tokens cross ranks by
    # all-to-all, and weights and balancing bias end as one process's.
    assert ranks[mode]["ep_group"]
    assert ranks[mode]["held"] == {"shape": held, "mesh": ("efsdp", "ep")}
    assert "1 MoE layer(s), 2 of 4 experts per rank (expert_parallel=2)" in ranks[mode]["summary"]
    assert_one_process(ranks[mode], single, mode)


@pytest.mark.distributed
def test_ema_averages_expert_parallel_weights_as_one_process(ranks: dict[str, Any]) -> None:
    from dream_trainer.callbacks import EMA

    ema = EMA(decay=0.5)
    MoETrainer(moe_config(8, 1, callbacks=[ema])).fit()
    expected = {key: value for key, value in ema.state_dict().items() if key != "num_updates"}
    averages = ranks["ep2"]["averages"]
    assert averages.keys() == expected.keys() and "model.moe.experts.w1" in averages
    for key, value in expected.items():
        # The averaged weights of runs that sum gradients in another order (see above).
        assert_close_to_scale(averages[key], value, ulps=16, msg=key)


@pytest.mark.distributed
def test_experts_that_do_not_split_over_the_ranks_are_refused(ranks: dict[str, Any]) -> None:
    error = ranks["ep_error"]["error"]
    assert error is not None and "num_experts=3, which expert_parallel=2 does not divide" in error


def test_active_parameters_count_top_k_of_the_experts_and_the_summary_prints_them() -> None:
    from dream_trainer.callbacks.summaries import ModelSummary
    from dream_trainer.nn import active_parameters

    stream = io.StringIO()
    summary = ModelSummary(max_depth=0, stream=stream)
    trainer = MoETrainer(moe_config(8, 1, callbacks=[summary]))
    trainer.fit()
    experts = 3 * DIM * HIDDEN * EXPERTS  # w1, w2, w3 of 4 experts
    total = sum(p.numel() for p in trainer.model.parameters())
    # top_k=2 of 4 experts: half of the expert weights are used by each token.
    assert active_parameters(trainer.model) == total - experts // 2
    assert summary.active_params == total - experts // 2 and summary.total_params == total
    printed = stream.getvalue()
    assert f"Active params per token: {total - experts // 2:,} (mixture of experts)" in printed
    assert "model: 1 MoE layer(s), 4 of 4 experts per rank (expert_parallel=1)" in printed
