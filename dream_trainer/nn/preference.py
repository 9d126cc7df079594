"""Preference-optimization losses (DPO, IPO, SimPO) from the log-probabilities of answers.

A preference batch holds every pair's chosen answer, then every pair's rejected answer, along
dim 0 (``PreferenceDataset``'s collate writes it so), so one forward pass of the policy, and one
of the reference model, serves both: ``sequence_log_probs`` sums each row's log-probabilities
over its answer tokens, ``split_pairs`` cuts the rows into the chosen and rejected halves, and a
loss turns the four halves into one loss per pair. The losses return per-pair values, not a
mean, so that the caller chooses the reduction (a sum with ``backward(loss, num_items=pairs)``
gives the mean over every pair of the global batch on any layout), and per-pair metrics named
as TRL logs them, so that they can be reduced over ranks like any other result.

Plain torch: nothing here knows about the trainer.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100
"""The label of a token that is not scored (the prompt, padding): transformers' and
``dream_trainer.data``'s ``-100``."""

_INTEGER_DTYPES = (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)

Metrics = dict[str, torch.Tensor]
"""Per-pair metrics, detached: ``rewards/chosen``, ``rewards/rejected``, ``rewards/margins``,
``rewards/accuracies`` (1.0 where the chosen reward is the higher), ``logps/chosen`` and
``logps/rejected`` (the policy's summed log-probabilities)."""


def sequence_log_probs(logits: torch.Tensor, labels: torch.Tensor,
                       ignore_index: int = IGNORE_INDEX, *, shifted: bool = False
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """Each sequence's summed log-probability of its labelled tokens, and how many there are.

    ``labels[b, i]`` is the token at position ``i`` itself (transformers' convention, as
    ``ChatDataset`` and ``PreferenceDataset`` write labels): the logits at ``i - 1`` score it,
    so position 0 is never scored. With ``shifted=True`` the labels are already the targets,
    ``labels[b, i]`` scored by ``logits[b, i]`` (a context-parallel rank's chunk of targets
    shifted before the sequence was split: the chunks' sums add up to the sequence's). The
    log-softmax is taken in float32 whatever the logits' dtype.

    Args:
        logits: ``[batch, sequence, vocab]`` floating logits.
        labels: ``[batch, sequence]`` integer labels, ``ignore_index`` where not scored.
        ignore_index: The label of tokens that are not scored.
        shifted: Whether ``labels`` are already aligned with ``logits`` (see above).

    Returns:
        ``(log_probs, tokens)``: float32 ``[batch]`` sums, and int64 ``[batch]`` counts of the
        scored tokens.

    Raises:
        ValueError: for logits that are not 3-D floating point, or labels that are not
            integers of shape ``[batch, sequence]``.
    """
    if logits.dim() != 3 or not logits.is_floating_point():
        raise ValueError(f"logits of shape {tuple(logits.shape)} and dtype {logits.dtype}: give "
                         "[batch, sequence, vocab] floating-point logits (a causal LM's "
                         "output.logits)")
    if labels.shape != logits.shape[:2] or labels.dtype not in _INTEGER_DTYPES:
        raise ValueError(f"labels of shape {tuple(labels.shape)} and dtype {labels.dtype} for "
                         f"logits of shape {tuple(logits.shape)}: give integer labels of shape "
                         f"{tuple(logits.shape[:2])}, {ignore_index} where a token is not scored")
    if not shifted:
        # Shift the labels, not the logits: a slice of the logits would be copied whole to be
        # flattened, the labels are small.
        labels = F.pad(labels[:, 1:], (0, 1), value=ignore_index)
    labels = labels.long()
    # cross_entropy is -log_softmax at the target, 0 where the target is ignored; float32 so
    # that bfloat16 logits lose nothing in the log-sum-exp.
    negative = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(),
                               ignore_index=ignore_index, reduction="none")
    return -negative.view(labels.shape).sum(dim=1), (labels != ignore_index).sum(dim=1)


def split_pairs(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The chosen and rejected halves of a tensor whose dim 0 holds every pair's chosen answer,
    then every pair's rejected answer (views, no copy).

    Raises:
        ValueError: for a 0-dim tensor or an odd dim 0.
    """
    if values.dim() == 0 or values.shape[0] % 2:
        raise ValueError(f"a tensor of shape {tuple(values.shape)} cannot be split into pairs: "
                         "dim 0 must hold the chosen rows then as many rejected rows (the "
                         "batch PreferenceDataset.collate writes)")
    pairs = values.shape[0] // 2
    return values[:pairs], values[pairs:]


def dpo_loss(policy_chosen: torch.Tensor, policy_rejected: torch.Tensor,
             reference_chosen: torch.Tensor, reference_rejected: torch.Tensor, *,
             beta: float = 0.1, label_smoothing: float = 0.0) -> tuple[torch.Tensor, Metrics]:
    """Direct Preference Optimization's sigmoid loss per pair (Rafailov et al., 2023), with
    cDPO's label smoothing.

    With ``h = (policy_chosen - reference_chosen) - (policy_rejected - reference_rejected)``,
    the loss is ``-(1 - label_smoothing) * logsigmoid(beta * h) - label_smoothing *
    logsigmoid(-beta * h)``. The rewards are ``beta * (policy - reference)`` of each answer.
    The reference log-probabilities are constants (detached).

    Args:
        policy_chosen: The policy's summed log-probability of each pair's chosen answer (the
            first half of ``sequence_log_probs``' sums, cut by ``split_pairs``).
        policy_rejected: The policy's, of each pair's rejected answer (the second half).
        reference_chosen: The reference model's, of each pair's chosen answer.
        reference_rejected: The reference model's, of each pair's rejected answer.
        beta: How far the policy may move from the reference (> 0; smaller is further).
        label_smoothing: The assumed probability that a pair's preference is flipped, in
            ``[0, 0.5)``.

    Returns:
        ``(losses, metrics)``: the loss of each pair, and per-pair ``Metrics``.

    Raises:
        ValueError: for inputs of different shapes or not floating point, ``beta <= 0`` or
            not finite, ``label_smoothing`` outside ``[0, 0.5)``.
    """
    _check_log_probs(policy_chosen=policy_chosen, policy_rejected=policy_rejected,
                     reference_chosen=reference_chosen, reference_rejected=reference_rejected)
    _check_beta(beta)
    _check_label_smoothing(label_smoothing)
    chosen_ratios = policy_chosen - reference_chosen.detach()
    rejected_ratios = policy_rejected - reference_rejected.detach()
    losses = _smoothed_sigmoid_loss(beta * (chosen_ratios - rejected_ratios), label_smoothing)
    return losses, _metrics(beta * chosen_ratios, beta * rejected_ratios, policy_chosen,
                            policy_rejected)


def ipo_loss(policy_chosen: torch.Tensor, policy_rejected: torch.Tensor,
             reference_chosen: torch.Tensor, reference_rejected: torch.Tensor, *,
             chosen_tokens: torch.Tensor, rejected_tokens: torch.Tensor,
             beta: float = 0.1) -> tuple[torch.Tensor, Metrics]:
    """Identity Preference Optimization's loss per pair (Azar et al., 2023, eq. 17) on
    log-ratios averaged per answer token, as TRL computes it.

    With ``h = (policy_chosen - reference_chosen) / chosen_tokens - (policy_rejected -
    reference_rejected) / rejected_tokens``, the loss is ``(h - 1 / (2 * beta)) ** 2``
    (``beta`` is the paper's tau). The rewards are ``beta * (policy - reference)`` of each
    answer, summed as in ``dpo_loss`` (TRL's DPOTrainer logs these). The reference
    log-probabilities are constants (detached).

    Args:
        policy_chosen: The policy's summed log-probability of each pair's chosen answer.
        policy_rejected: The policy's, of each pair's rejected answer.
        reference_chosen: The reference model's, of each pair's chosen answer.
        reference_rejected: The reference model's, of each pair's rejected answer.
        chosen_tokens: Each chosen answer's scored-token count (``sequence_log_probs``'
            second result, cut by ``split_pairs``), at least 1.
        rejected_tokens: Each rejected answer's, likewise.
        beta: The regularization (> 0): the target average log-ratio margin is
            ``1 / (2 * beta)``.

    Returns:
        ``(losses, metrics)``: the loss of each pair, and per-pair ``Metrics``.

    Raises:
        ValueError: for inputs of different shapes, log-probabilities not floating point,
            ``beta <= 0`` or not finite.
    """
    _check_log_probs(policy_chosen=policy_chosen, policy_rejected=policy_rejected,
                     reference_chosen=reference_chosen, reference_rejected=reference_rejected)
    _check_counts(policy_chosen, chosen_tokens=chosen_tokens, rejected_tokens=rejected_tokens)
    _check_beta(beta)
    chosen_ratios = policy_chosen - reference_chosen.detach()
    rejected_ratios = policy_rejected - reference_rejected.detach()
    margins = chosen_ratios / chosen_tokens - rejected_ratios / rejected_tokens
    losses = (margins - 1 / (2 * beta)) ** 2
    return losses, _metrics(beta * chosen_ratios, beta * rejected_ratios, policy_chosen,
                            policy_rejected)


def simpo_loss(policy_chosen: torch.Tensor, policy_rejected: torch.Tensor, *,
               chosen_tokens: torch.Tensor, rejected_tokens: torch.Tensor, beta: float = 2.0,
               gamma: float = 0.5, label_smoothing: float = 0.0) -> tuple[torch.Tensor, Metrics]:
    """SimPO's reference-free loss per pair (Meng et al., 2024, eq. 6), with label smoothing
    as TRL's CPO trainer applies it.

    With ``h = beta * policy_chosen / chosen_tokens - beta * policy_rejected / rejected_tokens
    - gamma``, the loss is ``-(1 - label_smoothing) * logsigmoid(h) - label_smoothing *
    logsigmoid(-h)``. The rewards are ``beta`` times each answer's log-probability averaged
    per token.

    Args:
        policy_chosen: The policy's summed log-probability of each pair's chosen answer.
        policy_rejected: The policy's, of each pair's rejected answer.
        chosen_tokens: Each chosen answer's scored-token count, at least 1.
        rejected_tokens: Each rejected answer's, likewise.
        beta: The scale of the length-normalized reward (> 0; the paper uses 2 to 2.5).
        gamma: The target reward margin (>= 0; TRL's ``simpo_gamma``, the paper's gamma).
        label_smoothing: The assumed probability that a pair's preference is flipped, in
            ``[0, 0.5)``.

    Returns:
        ``(losses, metrics)``: the loss of each pair, and per-pair ``Metrics``.

    Raises:
        ValueError: for inputs of different shapes, log-probabilities not floating point,
            ``beta <= 0`` or not finite, ``gamma`` negative or not finite,
            ``label_smoothing`` outside ``[0, 0.5)``.
    """
    _check_log_probs(policy_chosen=policy_chosen, policy_rejected=policy_rejected)
    _check_counts(policy_chosen, chosen_tokens=chosen_tokens, rejected_tokens=rejected_tokens)
    _check_beta(beta)
    if not (math.isfinite(gamma) and gamma >= 0):
        raise ValueError(f"gamma={gamma} must be a finite number >= 0 (the target reward "
                         "margin; SimPO's authors default to 0.5 with beta=2.0)")
    _check_label_smoothing(label_smoothing)
    chosen_rewards = beta * (policy_chosen / chosen_tokens)
    rejected_rewards = beta * (policy_rejected / rejected_tokens)
    losses = _smoothed_sigmoid_loss(chosen_rewards - rejected_rewards - gamma, label_smoothing)
    return losses, _metrics(chosen_rewards, rejected_rewards, policy_chosen, policy_rejected)


def _smoothed_sigmoid_loss(margins: torch.Tensor, label_smoothing: float) -> torch.Tensor:
    losses = -F.logsigmoid(margins)
    if label_smoothing == 0:
        # Not multiplied by 0: an infinite margin would turn the unused term into a NaN.
        return losses
    return (1 - label_smoothing) * losses - label_smoothing * F.logsigmoid(-margins)


def _metrics(chosen_rewards: torch.Tensor, rejected_rewards: torch.Tensor,
             policy_chosen: torch.Tensor, policy_rejected: torch.Tensor) -> Metrics:
    chosen_rewards, rejected_rewards = chosen_rewards.detach(), rejected_rewards.detach()
    return {"rewards/chosen": chosen_rewards,
            "rewards/rejected": rejected_rewards,
            "rewards/margins": chosen_rewards - rejected_rewards,
            "rewards/accuracies": (chosen_rewards > rejected_rewards).to(chosen_rewards.dtype),
            "logps/chosen": policy_chosen.detach(),
            "logps/rejected": policy_rejected.detach()}


def _check_log_probs(**log_probs: torch.Tensor) -> None:
    (first, expected), *others = log_probs.items()
    for name, value in log_probs.items():
        if not value.is_floating_point():
            raise ValueError(f"{name} has dtype {value.dtype}: give floating-point "
                             "log-probabilities (sequence_log_probs returns float32)")
    for name, value in others:
        if value.shape != expected.shape:
            raise ValueError(f"{name} has shape {tuple(value.shape)} but {first} has "
                             f"{tuple(expected.shape)}: give one value per pair to each (split "
                             "the batch's log-probabilities with split_pairs)")


def _check_counts(policy_chosen: torch.Tensor, **counts: torch.Tensor) -> None:
    # The counts' values are not checked (a count of 0 gives an infinite or NaN loss): that
    # would force a host sync every step, and PreferenceDataset never yields an empty answer.
    for name, value in counts.items():
        if value.shape != policy_chosen.shape:
            raise ValueError(f"{name} has shape {tuple(value.shape)} but policy_chosen has "
                             f"{tuple(policy_chosen.shape)}: give each answer's token count "
                             "(sequence_log_probs' second result, split with split_pairs)")


def _check_beta(beta: float) -> None:
    if not (math.isfinite(beta) and beta > 0):
        raise ValueError(f"beta={beta} must be a finite number > 0 (DPO and IPO commonly use "
                         "0.1, SimPO 2.0)")


def _check_label_smoothing(label_smoothing: float) -> None:
    if not 0 <= label_smoothing < 0.5:
        raise ValueError(f"label_smoothing={label_smoothing} must be in [0, 0.5): it is the "
                         "probability that a pair's preference is flipped (0.5 or more would "
                         "train the rejected answer); use 0 for none")
