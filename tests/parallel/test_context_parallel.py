"""Context parallelism: the sequence split over ranks trains exactly as one process.

The rotary GPT (``tests/helpers/rotary_gpt.py``: causal SDPA attention, a rotary position
table per block) trains 3 SGD steps of 2 accumulated micro-batches with binding clipping and
``num_items`` (targets ignored unevenly along the sequence, so the parts of a sequence count
different numbers of tokens), then validates. Under ``context_parallel=2`` on 2 ranks (with
and without load balancing, with activation checkpointing, with a mean loss, and written by
hand), and with FSDP2, HSDP, TP and a pipeline
on 4, the final weights equal one process's within 1e-6 (the ranks add the keys' partial
gradients and the parameters' in another order than one process: ~1.5e-8 here; a wrong
causal offset or token count moves them by ~1e-3). Two launches run them all; the one-process
references run in this process.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from dream_trainer.parallel.context import (SequenceSplit, _CausalChunks, lower_right_chunks,
                                            sequence_positions, split_problem)
from tests.helpers.launch import REPO, check, torchrun
from tests.helpers.hf import save_pretrained
from tests.scripts.context_runs import CLIP, hf_run, run

SCRIPT = REPO / "tests/scripts/context_runs.py"
ATOL = 1e-6
TWO_RANKS = ["cp2", "cp2_contiguous", "cp2_checkpointed", "cp2_mean", "cp2_hand", "hf_cp2",
             "ckpt_cp2", "cp2_odd_length"]
FOUR_RANKS = ["cp2_fsdp2", "cp2_tp2", "cp2_pp2", "cp2_hsdp"]


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    from dream_trainer.checkpoint.rng import rng_state, set_rng_state

    work = tmp_path_factory.mktemp("context")
    save_pretrained("llama", work / "pretrained")
    merged: dict[str, Any] = {}
    for nproc, names in ((2, TWO_RANKS), (4, FOUR_RANKS)):
        out = work / f"cp{nproc}.pt"
        check(torchrun(SCRIPT, [str(out), str(work), *names], nproc=nproc, timeout=400))
        merged.update(torch.load(out))
    # Killed after step 5 (its step-4 checkpoint written), then the same command again.
    killed = torchrun(SCRIPT, [str(work / "killed.pt"), str(work), "ckpt_cp2_kill"], nproc=2)
    merged["killed_returncode"] = killed.returncode
    check(torchrun(SCRIPT, [str(work / "resumed.pt"), str(work), "ckpt_cp2_kill"], nproc=2))
    merged.update(torch.load(work / "resumed.pt"))
    generators = rng_state()
    try:  # in this process: no launch, and the seeding is undone
        merged.update({name: run(name) for name in ("one", "one_mean")})
        merged["hf_one"] = hf_run("hf_one", work)
    finally:
        set_rng_state(generators)
    return merged


def reference_of(name: str) -> str:
    if name.startswith("hf_"):
        return "hf_one"
    return "one_mean" if name.endswith("_mean") else "one"  # "_hand": the same numerics


def assert_weights(got: dict[str, Any], expected: dict[str, Any]) -> None:
    assert got["weights"].keys() == expected["weights"].keys() and expected["weights"]
    for key, tensor in expected["weights"].items():
        torch.testing.assert_close(got["weights"][key], tensor, rtol=0, atol=ATOL, msg=key)
    # Not vacuous: both started from the same weights, and training moved them by far more
    # than the tolerance.
    for key, tensor in expected["initial"].items():
        assert torch.equal(got["initial"][key], tensor), key
    assert max((expected["weights"][key] - expected["initial"][key]).abs().max()
               for key in expected["weights"]) > 1e-3


@pytest.mark.distributed
@pytest.mark.parametrize("name", [name for name in TWO_RANKS + FOUR_RANKS
                                  if name.startswith("cp2") and name != "cp2_odd_length"])
def test_context_parallel_trains_as_one_process(results: dict[str, Any], name: str) -> None:
    got, expected = results[name], results[reference_of(name)]
    assert_weights(got, expected)
    # Clipping bound every step, and the norms are the whole model's, as one process's.
    assert min(expected["grad_norms"]) > CLIP
    torch.testing.assert_close(got["grad_norms"], expected["grad_norms"], rtol=1e-5, atol=0)


@pytest.mark.distributed
def test_a_llama_from_pretrained_weights_trains_as_one_process_and_exports(
        results: dict[str, Any]) -> None:
    """``transformers``' Llama under cp=2: its rotary positions come from the positions each
    rank holds; the export from inside the run reloads as the weights trained."""
    from transformers import AutoModelForCausalLM

    got = results["hf_cp2"]
    assert_weights(got, results["hf_one"])
    torch.testing.assert_close(got["losses"], results["hf_one"]["losses"], rtol=1e-6, atol=0)
    reloaded = AutoModelForCausalLM.from_pretrained(got["export"]).state_dict()
    assert reloaded.keys() == got["weights"].keys()
    for key, tensor in got["weights"].items():
        assert torch.equal(reloaded[key], tensor), key


@pytest.mark.distributed
@pytest.mark.parametrize("name", ["cp2", "cp2_contiguous", "cp2_tp2", "cp2_pp2"])
def test_losses_are_the_whole_sequences(results: dict[str, Any], name: str) -> None:
    """With one data-parallel rank, each step's loss and the validation loss are those of
    the whole sequences (the parts' sums added over the context-parallel ranks)."""
    got, expected = results[name], results["one"]
    torch.testing.assert_close(got["losses"], expected["losses"], rtol=1e-6, atol=0)
    torch.testing.assert_close(got["validation"]["val_loss"],
                               expected["validation"]["val_loss"], rtol=1e-6, atol=0)


@pytest.mark.distributed
def test_a_sequence_that_does_not_split_is_refused(results: dict[str, Any]) -> None:
    assert results["cp2_odd_length"]["error"] == (
        "a sequence of 14 positions does not split into 2 x context_parallel = 4 chunks (a "
        "head and a tail per rank, context_parallel_load_balance=True): pad or cut the "
        "sequences to a multiple of 4, or change context_parallel")


def test_balanced_positions_give_each_rank_a_head_and_a_tail() -> None:
    assert sequence_positions(8, 2, 0, balanced=True).tolist() == [0, 1, 6, 7]
    assert sequence_positions(8, 2, 1, balanced=True).tolist() == [2, 3, 4, 5]
    assert sequence_positions(8, 2, 1, balanced=False).tolist() == [4, 5, 6, 7]
    whole = torch.cat([sequence_positions(12, 3, rank, True) for rank in range(3)])
    assert sorted(whole.tolist()) == list(range(12))


def test_the_split_knows_its_chunks_and_the_keys_order() -> None:
    split = SequenceSplit(8, 2, 1, balanced=True, device=torch.device("cpu"))
    # Rank 1 holds positions 2..5; keys arrive as rank 0's [0, 1, 6, 7], then [2, 3, 4, 5].
    assert split.starts == [2, 4] and split.chunk == 2
    gathered = torch.tensor([0, 1, 6, 7, 2, 3, 4, 5])
    assert gathered[split.natural_order].tolist() == list(range(8))


@pytest.mark.parametrize("kernel", ["cpu_flash", "lower_right"])
@pytest.mark.parametrize(("ranks", "balanced"), [(2, True), (2, False), (4, True)])
def test_chunked_causal_attention_equals_one_process_in_value_and_gradient(
        kernel: str, ranks: int, balanced: bool) -> None:
    """Each rank's chunks of queries over the whole sequence's keys, as the CPU path
    (flash kernel blocks merged by log-sum-exp) and the CUDA path (lower-right causal bias)
    compute them: the outputs and the gradients summed over ranks equal one causal SDPA
    (float32 rounding: 1e-6)."""
    torch.manual_seed(0)
    length = 16
    q, k, v = (torch.randn(2, 3, length, 4, requires_grad=True) for _ in range(3))
    expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    grad = torch.randn_like(expected)
    expected.backward(grad)
    grads = [torch.zeros_like(t) for t in (q, k, v)]
    for rank in range(ranks):
        split = SequenceSplit(length, ranks, rank, balanced, torch.device("cpu"))
        local = q.detach()[..., split.local, :].requires_grad_()
        keys, values = (t.detach().clone().requires_grad_() for t in (k, v))
        args = (local, keys, values, split.starts, split.chunk)
        out = _CausalChunks.apply(*args, None) if kernel == "cpu_flash" \
            else lower_right_chunks(*args)
        torch.testing.assert_close(out, expected.detach()[..., split.local, :], rtol=0,
                                   atol=1e-6)
        out.backward(grad[..., split.local, :])
        grads[0][..., split.local, :] += local.grad
        grads[1] += keys.grad
        grads[2] += values.grad
    for got, tensor in zip(grads, (q, k, v)):
        torch.testing.assert_close(got, tensor.grad, rtol=0, atol=1e-6)


def test_split_problem_names_the_fields() -> None:
    assert split_problem(16, 2, balanced=True) is None
    assert split_problem(6, 4, balanced=False) == (
        "a sequence of 6 positions does not split into context_parallel = 4 chunks: pad or "
        "cut the sequences to a multiple of 4, or change context_parallel")


@pytest.mark.distributed
def test_a_run_killed_under_context_parallelism_resumes_bit_exactly(
        results: dict[str, Any]) -> None:
    assert results["killed_returncode"] != 0
    resumed, uninterrupted = results["ckpt_cp2_kill"], results["ckpt_cp2"]
    assert resumed["global_step"] == uninterrupted["global_step"] == 6
    assert resumed["weights"].keys() == uninterrupted["weights"].keys()
    for key, tensor in uninterrupted["weights"].items():
        assert torch.equal(resumed["weights"][key], tensor), key
