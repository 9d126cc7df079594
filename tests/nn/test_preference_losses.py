"""The preference losses on a tiny transformers Llama: DPO (with cDPO's label smoothing), IPO
and SimPO, their gradients with respect to the policy's weights and their metrics equal
hand-written computations of the papers' formulas and TRL's own loss code; the log-probability
sums are taken over the answer tokens only, in float32, from one forward pass of the chosen and
rejected rows; bad arguments are refused with the messages stated."""

from __future__ import annotations

import copy
import math
import tempfile
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dream_trainer.nn import dpo_loss, ipo_loss, sequence_log_probs, simpo_loss, split_pairs
from tests.helpers.hf import VOCAB, build
from tests.helpers.tolerance import assert_close_to_scale, assert_tensors_close_to_scale

IGNORE = -100
# Two different float32 computations of the same values (cross_entropy's fused log-softmax and
# a sum over the row, against a per-token log_softmax added up in a Python loop; TRL's tiled
# fused head): they round differently, by a few ulps per reduction. 8 ulps of the values' scale
# is 9.5e-7 of it: the 1e-6 the issue asks for, stated relative to the scale so that it holds
# on every CPU.
ULPS = 8
# (prompt tokens, chosen answer tokens, rejected answer tokens) of each pair.
PAIRS = [(3, 5, 2), (6, 1, 4), (2, 7, 7)]


def preference_batch() -> dict[str, torch.Tensor]:
    """Three pairs of random token sequences, as PreferenceDataset.collate lays them out:
    chosen rows then rejected rows, padded on the right, labels -100 off the answers."""
    generator = torch.Generator().manual_seed(3)
    rows = []
    for answer in (1, 2):
        for pair in PAIRS:
            prompt = torch.randint(0, VOCAB, (pair[0],), generator=generator)
            tokens = torch.randint(0, VOCAB, (pair[answer],), generator=generator)
            rows.append((prompt, tokens))
    longest = max(len(prompt) + len(tokens) for prompt, tokens in rows)
    batch = {"input_ids": torch.zeros(len(rows), longest, dtype=torch.long),
             "labels": torch.full((len(rows), longest), IGNORE),
             "attention_mask": torch.zeros(len(rows), longest, dtype=torch.long)}
    for row, (prompt, tokens) in enumerate(rows):
        ids = torch.cat([prompt, tokens])
        batch["input_ids"][row, :len(ids)] = ids
        batch["labels"][row, len(prompt):len(ids)] = tokens
        batch["attention_mask"][row, :len(ids)] = 1
    return batch


@pytest.fixture(scope="module")
def models() -> tuple[nn.Module, nn.Module]:
    """A policy and a reference with other weights, both float32 Llamas of 2 layers."""
    torch.manual_seed(0)
    policy = build("llama")
    torch.manual_seed(1)
    reference = build("llama").eval().requires_grad_(False)
    return policy, reference


def logits_of(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits


def hand_log_probs(logits: torch.Tensor, labels: torch.Tensor) -> tuple[list[Any], list[int]]:
    """Each row's log-probability of its answer, token by token: log_softmax of the logits at
    the position before each labelled token, at that token, added up in order."""
    sums, counts = [], []
    for row in range(labels.shape[0]):
        total: Any = 0.0
        count = 0
        for position in range(1, labels.shape[1]):
            token = int(labels[row, position])
            if token != IGNORE:
                total = total + torch.log_softmax(logits[row, position - 1], dim=-1)[token]
                count += 1
        sums.append(total)
        counts.append(count)
    return sums, counts


def scales(loss: str, beta: float, smoothing: float, gamma: float, losses: torch.Tensor,
           metrics: dict[str, torch.Tensor], logits: torch.Tensor,
           reference_logits: torch.Tensor, batch: dict[str, torch.Tensor]
           ) -> tuple[float, float, float]:
    """The scales the losses and the rewards are compared at, and the factor by which the
    gradients' bound grows.

    The two computations differ in how the log-probability sums round, relative to their size
    (a sum's terms all have one sign). The losses and rewards are functions of each pair's
    margin, a difference of sums, so they are held to the margin's terms' scale times how fast
    they move with it (|d loss / d margin| <= 1 for the sigmoids, 2 |h - 1/(2 beta)| for IPO).
    The gradient is each pair's weight w = d loss / d margin times the margin's gradient, so
    the margin's rounding reaches it relative to w as the margin's scale times |w'| / |w|:
    below 1 for an unsmoothed sigmoid loss with a small beta, large where w nearly cancels
    (IPO's h near its target 1/(2 beta), or a smoothed sigmoid near its balance point).
    """
    sums, counts = (torch.cat(values) for values in zip(
        sequence_log_probs(logits.detach(), batch["labels"]),
        sequence_log_probs(reference_logits, batch["labels"])))
    total, average = float(sums.abs().max()), float((sums / counts).abs().max())
    own = float(losses.abs().max())
    if loss == "ipo":  # in h: w = 2 (h - 1/(2 beta)) = +-2 sqrt(loss), w' = 2
        offsets = losses.sqrt()
        return (max(own, 2 * float(offsets.max()) * average), beta * total,
                max(1.0, average / float(offsets.min())))
    # In m (the sigmoid's argument): w = -(1 - e) sigmoid(-m) + e sigmoid(m),
    # w' = sigmoid(m) sigmoid(-m).
    margins = metrics["rewards/margins"] - gamma
    weights = -(1 - smoothing) * torch.sigmoid(-margins) + smoothing * torch.sigmoid(margins)
    curvature = float((torch.sigmoid(margins) * torch.sigmoid(-margins) / weights.abs()).max())
    terms = beta * (total if loss == "dpo" else average)
    return max(own, terms), terms, max(1.0, terms * curvature)


def minus_log_sigmoid(x: torch.Tensor) -> torch.Tensor:
    """-log(sigmoid(x)) = log(1 + exp(-x)), written out (not F.logsigmoid)."""
    return torch.log1p(torch.exp(-x))


def hand_losses(loss: str, beta: float, smoothing: float, gamma: float,
                policy: tuple[list[Any], list[int]],
                reference: tuple[list[Any], list[int]]) -> tuple[list[Any], list[Any],
                                                                 list[Any]]:
    """Each pair's loss and rewards from the papers' formulas, one pair at a time."""
    (logps, counts), (ref_logps, _) = policy, reference
    pairs = len(logps) // 2
    losses, chosen_rewards, rejected_rewards = [], [], []
    for i in range(pairs):
        chosen, rejected = logps[i], logps[pairs + i]
        chosen_count, rejected_count = counts[i], counts[pairs + i]
        if loss == "simpo":  # Meng et al. eq. 6: length-normalized, no reference
            chosen_reward = beta / chosen_count * chosen
            rejected_reward = beta / rejected_count * rejected
            x = chosen_reward - rejected_reward - gamma
            value = (1 - smoothing) * minus_log_sigmoid(x) + smoothing * minus_log_sigmoid(-x)
        else:
            chosen_ratio = chosen - ref_logps[i]
            rejected_ratio = rejected - ref_logps[pairs + i]
            chosen_reward, rejected_reward = beta * chosen_ratio, beta * rejected_ratio
            if loss == "dpo":  # Rafailov et al. eq. 7, cDPO's smoothing
                x = beta * (chosen_ratio - rejected_ratio)
                value = ((1 - smoothing) * minus_log_sigmoid(x)
                         + smoothing * minus_log_sigmoid(-x))
            else:  # Azar et al. eq. 17, on per-token log-ratios as TRL
                h = chosen_ratio / chosen_count - rejected_ratio / rejected_count
                value = (h - 1 / (2 * beta)) ** 2
        losses.append(value)
        chosen_rewards.append(chosen_reward)
        rejected_rewards.append(rejected_reward)
    return losses, chosen_rewards, rejected_rewards


def our_losses(loss: str, beta: float, smoothing: float, gamma: float,
               logits: torch.Tensor, reference_logits: torch.Tensor,
               labels: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    logps, tokens = sequence_log_probs(logits, labels)
    ref_logps, _ = sequence_log_probs(reference_logits, labels)
    (chosen, rejected), (ref_chosen, ref_rejected) = split_pairs(logps), split_pairs(ref_logps)
    chosen_tokens, rejected_tokens = split_pairs(tokens)
    if loss == "dpo":
        return dpo_loss(chosen, rejected, ref_chosen, ref_rejected, beta=beta,
                        label_smoothing=smoothing)
    if loss == "ipo":
        return ipo_loss(chosen, rejected, ref_chosen, ref_rejected, beta=beta,
                        chosen_tokens=chosen_tokens, rejected_tokens=rejected_tokens)
    return simpo_loss(chosen, rejected, chosen_tokens=chosen_tokens,
                      rejected_tokens=rejected_tokens, beta=beta, gamma=gamma,
                      label_smoothing=smoothing)


def gradients(model: nn.Module, loss: torch.Tensor) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    loss.backward()
    grads = {name: param.grad.detach().clone() for name, param in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return grads


CASES = [("dpo", 0.1, 0.0, 0.0), ("dpo", 0.5, 0.2, 0.0), ("ipo", 0.1, 0.0, 0.0),
         ("ipo", 2.0, 0.0, 0.0), ("simpo", 2.0, 0.0, 0.5), ("simpo", 2.5, 0.1, 1.0)]


@pytest.mark.parametrize(("loss", "beta", "smoothing", "gamma"), CASES,
                         ids=[f"{c[0]}-beta{c[1]}-ls{c[2]}-gamma{c[3]}" for c in CASES])
def test_loss_and_policy_gradients_equal_the_papers_formulas(models, loss, beta, smoothing,
                                                             gamma) -> None:
    policy, reference = models
    batch = preference_batch()
    with torch.no_grad():
        reference_logits = logits_of(reference, batch)

    logits = logits_of(policy, batch)
    losses, metrics = our_losses(loss, beta, smoothing, gamma, logits, reference_logits,
                                 batch["labels"])
    ours = gradients(policy, losses.mean())

    again = logits_of(policy, batch)
    assert torch.equal(again, logits)  # the same forward: only the loss is computed otherwise
    expected, chosen_rewards, rejected_rewards = hand_losses(
        loss, beta, smoothing, gamma, hand_log_probs(again, batch["labels"]),
        hand_log_probs(reference_logits, batch["labels"]))
    expected_mean = sum(expected) / len(expected)
    theirs = gradients(policy, expected_mean)
    loss_scale, reward_scale, amplification = scales(loss, beta, smoothing, gamma,
                                                     losses.detach(), metrics, again,
                                                     reference_logits, batch)

    assert losses.shape == (len(PAIRS),) and losses.dtype == torch.float32
    assert_close_to_scale(losses.detach(), torch.stack(expected).detach(), ulps=ULPS,
                          scale=loss_scale)
    # At the scale of all the gradients: a tensor's entries are sums over tokens of both
    # signs (chosen pushed up, rejected down), so one may cancel to far below its terms, whose
    # rounding is what differs.
    assert_tensors_close_to_scale(ours, theirs, ulps=ULPS * amplification, shared_scale=True,
                                  msg=loss)
    assert any(grad.abs().max() > 0 for grad in ours.values())

    assert_close_to_scale(metrics["rewards/chosen"], torch.stack(chosen_rewards).detach(),
                          ulps=ULPS, scale=reward_scale)
    assert_close_to_scale(metrics["rewards/rejected"], torch.stack(rejected_rewards).detach(),
                          ulps=ULPS, scale=reward_scale)
    assert torch.equal(metrics["rewards/margins"],
                       metrics["rewards/chosen"] - metrics["rewards/rejected"])
    assert torch.equal(metrics["rewards/accuracies"],
                       (metrics["rewards/chosen"] > metrics["rewards/rejected"]).float())
    assert all(not value.requires_grad for value in metrics.values())
    assert sorted(metrics) == ["logps/chosen", "logps/rejected", "rewards/accuracies",
                               "rewards/chosen", "rewards/margins", "rewards/rejected"]


def test_sequence_log_probs_scores_the_answer_tokens_only(models) -> None:
    policy, _ = models
    batch = preference_batch()
    with torch.no_grad():
        logits = logits_of(policy, batch)
    logps, tokens = sequence_log_probs(logits, batch["labels"])
    assert tokens.tolist() == [pair[1] for pair in PAIRS] + [pair[2] for pair in PAIRS]
    assert tokens.dtype == torch.int64 and logps.dtype == torch.float32
    hand, counts = hand_log_probs(logits, batch["labels"])
    assert counts == tokens.tolist()
    assert_close_to_scale(logps, torch.stack(hand), ulps=ULPS)

    # The prompt and the padding do not count: other ids and logits there change nothing.
    changed = logits.clone()
    answer_targets = F.pad(batch["labels"][:, 1:] != IGNORE, (0, 1))
    changed[~answer_targets] = torch.randn_like(changed[~answer_targets])
    assert torch.equal(sequence_log_probs(changed, batch["labels"])[0], logps)

    # One forward of the concatenated rows gives each row's own log-probability: each
    # sequence alone, unpadded, through the model. Attention over a padded batch runs another
    # kernel shape, so the logits differ by rounding: 64 ulps of the scale.
    for row in range(batch["labels"].shape[0]):
        length = int(batch["attention_mask"][row].sum())
        with torch.no_grad():
            alone = policy(input_ids=batch["input_ids"][row:row + 1, :length]).logits
        mine, _ = sequence_log_probs(alone, batch["labels"][row:row + 1, :length])
        assert_close_to_scale(mine, logps[row:row + 1], ulps=64, msg=f"row {row}")


def test_sequence_log_probs_is_float32_from_bfloat16_logits() -> None:
    generator = torch.Generator().manual_seed(5)
    logits = (torch.randn(4, 6, 50, generator=generator) * 8).bfloat16()
    labels = torch.randint(0, 50, (4, 6), generator=generator)
    labels[:, :2] = IGNORE
    logps, _ = sequence_log_probs(logits, labels)
    assert logps.dtype == torch.float32
    # The same computation on the logits upcast first: the upcast is all that happens.
    assert torch.equal(logps, sequence_log_probs(logits.float(), labels)[0])
    # bfloat16 arithmetic would be further off: the float32 result is the float64 one.
    exact = torch.stack(hand_log_probs(logits.double(), labels)[0])
    assert_close_to_scale(logps.double(), exact, ulps=ULPS, dtype=torch.float32)


def test_shifted_labels_and_sequence_chunks_add_up_to_the_whole() -> None:
    generator = torch.Generator().manual_seed(6)
    logits = torch.randn(4, 10, 30, generator=generator)
    labels = torch.randint(0, 30, (4, 10), generator=generator)
    labels[0, :4] = IGNORE
    labels[3, 7:] = IGNORE
    whole, tokens = sequence_log_probs(logits, labels)
    targets = F.pad(labels[:, 1:], (0, 1), value=IGNORE)
    # Already-shifted targets: the same computation, bit for bit.
    shifted, shifted_tokens = sequence_log_probs(logits, targets, shifted=True)
    assert torch.equal(shifted, whole) and torch.equal(shifted_tokens, tokens)
    # A context-parallel rank's chunk: the sums of the chunks add up to the whole (summed in
    # another order: ulps).
    chunks = [sequence_log_probs(logits[:, i:i + 4], targets[:, i:i + 4], shifted=True)
              for i in (0, 4, 8)]
    assert_close_to_scale(sum(chunk[0] for chunk in chunks), whole, ulps=ULPS)
    assert torch.equal(sum(chunk[1] for chunk in chunks), tokens)


def test_split_pairs_returns_the_chosen_then_the_rejected_half_as_views() -> None:
    values = torch.arange(12).view(6, 2)
    chosen, rejected = split_pairs(values)
    assert chosen.tolist() == [[0, 1], [2, 3], [4, 5]]
    assert rejected.tolist() == [[6, 7], [8, 9], [10, 11]]
    assert chosen.data_ptr() == values.data_ptr()
    for bad in (torch.zeros(5), torch.tensor(1.0)):
        with pytest.raises(ValueError) as error:
            split_pairs(bad)
        assert str(error.value) == (
            f"a tensor of shape {tuple(bad.shape)} cannot be split into pairs: dim 0 must hold "
            "the chosen rows then as many rejected rows (the batch PreferenceDataset.collate "
            "writes)")


def refused(call: Callable[[], Any]) -> str:
    with pytest.raises(ValueError) as error:
        call()
    return str(error.value)


def test_bad_arguments_are_refused_naming_the_fix() -> None:
    x, y = torch.zeros(3), torch.zeros(4)
    counts = torch.ones(3, dtype=torch.long)
    assert refused(lambda: dpo_loss(x, x, x, y)) == (
        "reference_rejected has shape (4,) but policy_chosen has (3,): give one value per pair "
        "to each (split the batch's log-probabilities with split_pairs)")
    assert refused(lambda: dpo_loss(x, x.long(), x, x)) == (
        "policy_rejected has dtype torch.int64: give floating-point log-probabilities "
        "(sequence_log_probs returns float32)")
    for beta in (0.0, -1.0, math.inf, math.nan):
        assert refused(lambda: dpo_loss(x, x, x, x, beta=beta)) == (
            f"beta={beta} must be a finite number > 0 (DPO and IPO commonly use 0.1, SimPO 2.0)")
    for smoothing in (-0.1, 0.5, 0.7):
        assert refused(lambda: dpo_loss(x, x, x, x, label_smoothing=smoothing)) == (
            f"label_smoothing={smoothing} must be in [0, 0.5): it is the probability that a "
            "pair's preference is flipped (0.5 or more would train the rejected answer); use 0 "
            "for none")
    assert refused(lambda: simpo_loss(x, x, chosen_tokens=counts, rejected_tokens=counts,
                                      label_smoothing=0.5)).startswith("label_smoothing=0.5 ")
    assert refused(lambda: ipo_loss(x, x, x, x, chosen_tokens=counts,
                                    rejected_tokens=torch.ones(4))) == (
        "rejected_tokens has shape (4,) but policy_chosen has (3,): give each answer's token "
        "count (sequence_log_probs' second result, split with split_pairs)")
    assert refused(lambda: ipo_loss(x, x, x, x, chosen_tokens=counts, rejected_tokens=counts,
                                    beta=0)).startswith("beta=0 must be a finite number > 0")
    assert refused(lambda: simpo_loss(x, y, chosen_tokens=counts, rejected_tokens=counts)) == (
        "policy_rejected has shape (4,) but policy_chosen has (3,): give one value per pair to "
        "each (split the batch's log-probabilities with split_pairs)")
    for gamma in (-0.5, math.inf):
        assert refused(lambda: simpo_loss(x, x, chosen_tokens=counts, rejected_tokens=counts,
                                          gamma=gamma)) == (
            f"gamma={gamma} must be a finite number >= 0 (the target reward margin; SimPO's "
            "authors default to 0.5 with beta=2.0)")

    logits = torch.zeros(2, 5, 7)
    assert refused(lambda: sequence_log_probs(logits[0], torch.zeros(5, dtype=torch.long))) == (
        "logits of shape (5, 7) and dtype torch.float32: give [batch, sequence, vocab] "
        "floating-point logits (a causal LM's output.logits)")
    assert refused(lambda: sequence_log_probs(logits, torch.zeros(2, 4, dtype=torch.long))) == (
        "labels of shape (2, 4) and dtype torch.int64 for logits of shape (2, 5, 7): give "
        "integer labels of shape (2, 5), -100 where a token is not scored")
    assert refused(lambda: sequence_log_probs(logits, torch.zeros(2, 5))).startswith(
        "labels of shape (2, 5) and dtype torch.float32 ")


def test_reference_log_probs_are_constants_and_smoothing_zero_adds_no_term() -> None:
    chosen = torch.tensor([-3.0, -5.0], requires_grad=True)
    rejected = torch.tensor([-4.0, -2.0], requires_grad=True)
    ref_chosen = torch.tensor([-3.5, -4.0], requires_grad=True)
    ref_rejected = torch.tensor([-3.0, -3.0], requires_grad=True)
    losses, _ = dpo_loss(chosen, rejected, ref_chosen, ref_rejected, beta=0.5)
    losses.sum().backward()
    assert ref_chosen.grad is None and ref_rejected.grad is None
    assert chosen.grad is not None and rejected.grad is not None
    # An infinite margin: the loss is 0, not the NaN of 0 * inf in the unused smoothing term.
    losses, metrics = dpo_loss(torch.tensor([0.0]), torch.tensor([-math.inf]),
                               torch.tensor([0.0]), torch.tensor([0.0]))
    assert losses.tolist() == [0.0] and metrics["rewards/accuracies"].tolist() == [1.0]


# TRL's own loss code, as a second reference: DPOTrainer's compute_loss (its sigmoid and IPO
# losses, from the log-probabilities of its fused LM head) on the same batch, and the
# experimental CPO trainer's loss function (SimPO; and DPO's label smoothing, which TRL 1.16
# keeps only there: with a zero reference, cDPO's loss is CPO's smoothed sigmoid).

def trl_dpo_trainer(policy: nn.Module, reference: nn.Module, loss: str, beta: float) -> Any:
    from datasets import Dataset
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from trl import DPOConfig, DPOTrainer

    backend = Tokenizer(models.WordLevel({"<unk>": 0, "<pad>": 1, "a": 2}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>",
                                        pad_token="<pad>", eos_token="<pad>")
    # The dataset only satisfies the constructor: compute_loss is given our batch.
    data = Dataset.from_list([{"prompt": "a", "chosen": " a", "rejected": " a a"}])
    # bf16=False: TRL defaults to bfloat16 autocast, which would compare another precision.
    args = DPOConfig(output_dir=tempfile.mkdtemp(), report_to=[], use_cpu=True, beta=beta,
                     loss_type=[loss], gradient_checkpointing=False, bf16=False)
    return DPOTrainer(model=policy, ref_model=reference, args=args, processing_class=tokenizer,
                      train_dataset=data)


# TRL 1.16's config still sets transformers' deprecated gradient_checkpointing field.
@pytest.mark.filterwarnings("ignore:`gradient_checkpointing` is deprecated:FutureWarning",
                            "ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")
@pytest.mark.parametrize(("loss", "beta"), [("sigmoid", 0.1), ("ipo", 0.5)])
def test_dpo_and_ipo_equal_trl_dpo_trainer(models, loss, beta) -> None:
    policy, reference = models
    batch = preference_batch()
    trainer = trl_dpo_trainer(copy.deepcopy(policy), copy.deepcopy(reference), loss, beta)
    trl_batch = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"],
                 "completion_mask": (batch["labels"] != IGNORE).long()}
    trl_loss = trainer.compute_loss(trainer.model, trl_batch)
    trl_grads = gradients(trainer.model, trl_loss)
    trl_metrics = {key: values[-1] for key, values in trainer._metrics["train"].items()}

    with torch.no_grad():
        reference_logits = logits_of(reference, batch)
    losses, metrics = our_losses("dpo" if loss == "sigmoid" else "ipo", beta, 0.0, 0.0,
                                 logits_of(policy, batch), reference_logits, batch["labels"])
    grads = gradients(policy, losses.mean())

    assert_close_to_scale(losses.mean().detach(), trl_loss.detach(), ulps=ULPS)
    assert_tensors_close_to_scale(grads, trl_grads, ulps=ULPS, shared_scale=True,
                                  msg=f"TRL {loss}")
    # TRL logs each metric's batch mean as a Python float. The rewards are differences of
    # log-probability sums, which round relative to the sums (see above).
    terms = torch.cat([metrics["logps/chosen"], metrics["logps/rejected"],
                       sequence_log_probs(reference_logits, batch["labels"])[0]])
    for key in ("rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen",
                "logps/rejected"):
        scale = float(terms.abs().max()) * (beta if key.startswith("rewards") else 1)
        assert_close_to_scale(metrics[key].mean().item(), trl_metrics[key], ulps=ULPS,
                              scale=scale, dtype=torch.float32, msg=key)
    assert metrics["rewards/accuracies"].mean().item() == trl_metrics["rewards/accuracies"]


@pytest.mark.parametrize(("loss", "beta", "smoothing", "gamma"),
                         [("simpo", 2.0, 0.0, 0.5), ("simpo", 2.5, 0.2, 1.2),
                          ("sigmoid", 0.3, 0.2, 0.0)])
def test_simpo_and_label_smoothing_equal_trl_cpo_loss(models, loss, beta, smoothing,
                                                      gamma) -> None:
    from trl.experimental.cpo import CPOTrainer

    policy, _ = models
    batch = preference_batch()
    with torch.no_grad():
        logps, tokens = sequence_log_probs(logits_of(policy, batch), batch["labels"])
    (chosen, rejected), (chosen_tokens, rejected_tokens) = split_pairs(logps), split_pairs(tokens)
    # cpo_loss reads only these attributes of its trainer.
    settings = SimpleNamespace(alpha=0.0, loss_type=loss, beta=beta, label_smoothing=smoothing,
                               simpo_gamma=gamma, accelerator=SimpleNamespace(device="cpu"))
    if loss == "simpo":  # CPO averages the log-probabilities per token for SimPO
        trl_losses, trl_chosen, trl_rejected = CPOTrainer.cpo_loss(
            settings, chosen / chosen_tokens, rejected / rejected_tokens)
        losses, metrics = simpo_loss(chosen, rejected, chosen_tokens=chosen_tokens,
                                     rejected_tokens=rejected_tokens, beta=beta, gamma=gamma,
                                     label_smoothing=smoothing)
    else:
        trl_losses, trl_chosen, trl_rejected = CPOTrainer.cpo_loss(settings, chosen, rejected)
        zero = torch.zeros_like(chosen)
        losses, metrics = dpo_loss(chosen, rejected, zero, zero, beta=beta,
                                   label_smoothing=smoothing)
    assert_close_to_scale(losses, trl_losses, ulps=ULPS)
    assert_close_to_scale(metrics["rewards/chosen"], trl_chosen, ulps=ULPS)
    assert_close_to_scale(metrics["rewards/rejected"], trl_rejected, ulps=ULPS)
