"""The DPO memory benchmark runs its three variants on 2 ranks (tiny size) and reports sane
fields; the figures at this size are noise, so no timing or memory ordering between the
variants is checked."""

from __future__ import annotations

import pytest
import torch

from benchmarks.dpo_memory import (IGNORE, VARIANTS, answer_targets, markdown, measure, pairs,
                                   prompt_length)
from benchmarks.lora_memory import QUICK


def test_pairs_share_their_prompt_and_only_answers_are_scored() -> None:
    items = pairs(QUICK)
    indices, chosen, rejected = items.tensors
    assert torch.equal(indices, torch.arange(2 * QUICK.batch))  # two steps' global batches
    assert chosen.shape == rejected.shape == (2 * QUICK.batch, QUICK.seq)
    prompt = prompt_length(QUICK.seq)
    assert prompt == 4
    assert torch.equal(chosen[:, :prompt], rejected[:, :prompt])
    assert not torch.equal(chosen[:, prompt:], rejected[:, prompt:])
    targets = answer_targets(chosen)
    # Position i scores token i + 1: the answer's tokens (from `prompt` on), the last none.
    assert (targets[:, :prompt - 1] == IGNORE).all() and (targets[:, -1] == IGNORE).all()
    assert torch.equal(targets[:, prompt - 1:-1], chosen[:, prompt:])


@pytest.mark.distributed
def test_dpo_memory_benchmark_reports_every_variant_per_rank() -> None:
    result = measure(QUICK)
    assert result["params"] == QUICK.params() and result["model_bytes"] == 4 * QUICK.params()
    assert result["sharded"]["trainable_params"] == QUICK.params()
    assert result["precomputed"]["trainable_params"] == QUICK.params()
    assert result["base"]["trainable_params"] == QUICK.adapter_params()
    # The reference is split between the ranks (FSDP2), or absent (the base is the reference).
    for variant in ("sharded", "precomputed"):
        held = result[variant]["reference_bytes_per_rank"]
        assert sum(held) == result["model_bytes"] and 0 < min(held), (variant, held)
    assert result["base"]["reference_bytes_per_rank"] == [0, 0]
    for variant in VARIANTS:
        figures = result[variant]
        setup, before = (figures["setup_peak_above_baseline_bytes"],
                         figures["before_steps_peak_above_baseline_bytes"])
        peaks = figures["peak_above_baseline_bytes"]
        assert len(setup) == len(before) == len(peaks) == 2
        # A process's peak only grows: end of setup, first step, end of the second step.
        assert all(0 < s <= b <= p for s, b, p in zip(setup, before, peaks)), (
            variant, setup, before, peaks)
        # The kernel's current and peak RSS are not exact to a few hundred KiB (one read 350
        # KiB above the peak at this size), so only the sign of the current one is checked.
        assert all(rss > 0 for rss in figures["first_step_rss_above_baseline_bytes"]), variant
    for variant in ("precomputed", "base"):
        assert result["ratio"][variant] == max(result[variant]["peak_above_baseline_bytes"]) / max(
            result["sharded"]["peak_above_baseline_bytes"])
    rows = markdown(result)
    assert len(rows) == 5 and rows[-1].endswith(f"| {result['ratio']['base']:.2f} |")
