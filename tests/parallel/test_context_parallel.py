"""Context parallelism: the sequence split over ranks trains exactly as one process.

The rotary GPT (``tests/helpers/rotary_gpt.py``: causal SDPA attention, a rotary position
table per block) trains 3 SGD steps of 2 accumulated micro-batches with binding clipping and
``num_items`` (targets ignored unevenly along the sequence, so the parts of a sequence count
different numbers of tokens), then validates. Under ``context_parallel=2`` on 2 ranks (with
and without load balancing, with activation checkpointing, with a mean loss, and written by
hand), and with FSDP2, HSDP, TP and a pipeline
on 4, the final weights equal one process's within 16 ulps of each one's scale (the ranks add
the keys' partial gradients and the parameters' in another order than one process: ~1.5e-8
here; a wrong causal offset or token count moves them by ~1e-3). Two launches run them all;
the one-process references run in this process.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from dream_trainer.parallel.context_attention import (_CausalChunks, lower_right_chunks,
                                                      window_chunks)
from dream_trainer.parallel.context_hf import check_attention
from dream_trainer.parallel.context_split import SequenceSplit, sequence_positions, split_problem
from tests.helpers.launch import REPO, check, torchrun
from tests.helpers.hf import save_pretrained
from tests.helpers.tolerance import assert_close_to_scale
from tests.scripts.context_runs import CLIP, hf_run, run, window_model, window_run

SCRIPT = REPO / "tests/scripts/context_runs.py"
# Final weights: the ranks add partial gradients in another order than one process, and 3 SGD
# steps carry those few-ulp gradient differences into weights of scale ~1.
WEIGHT_ULPS = 16
WINDOWS = ["mistral12", "mistral6", "mistral3", "qwen2"]
TWO_RANKS = ["cp2", "cp2_contiguous", "cp2_checkpointed", "cp2_mean", "cp2_hand", "hf_cp2",
             "ckpt_cp2", "cp2_odd_length", *(f"window_{model}_cp2" for model in WINDOWS),
             "window_padded_cp2"]
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
        merged.update({f"window_{model}_one": window_run(f"window_{model}_one", work)
                       for model in WINDOWS})
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
        assert_close_to_scale(got["weights"][key], tensor, ulps=WEIGHT_ULPS, msg=key)
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


def assert_split_attention_is_one_sdpa(ranks: int, balanced: bool, heads: int, dim: int,
                                       mask: torch.Tensor | None, attend: Any) -> None:
    """``attend(local queries, keys, values, split)`` on each rank's part equals one SDPA over
    the whole sequence (causal without ``mask``), in value and in the gradients summed over
    ranks. Float32 rounding of other blocks and orders: a few ulps of the scale are seen (on
    AVX512, AVX2 and ATen's default kernels), of a scale set by the terms that cancel."""
    torch.manual_seed(0)
    length = 16
    q, k, v = (torch.randn(2, heads, length, dim, requires_grad=True) for _ in range(3))
    expected = torch.nn.functional.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, is_causal=mask is None)
    grad = torch.randn_like(expected)
    expected.backward(grad)
    grads = [torch.zeros_like(t) for t in (q, k, v)]
    for rank in range(ranks):
        split = SequenceSplit(length, ranks, rank, balanced, torch.device("cpu"))
        local = q.detach()[..., split.local, :].requires_grad_()
        keys, values = (t.detach().clone().requires_grad_() for t in (k, v))
        out = attend(local, keys, values, split)
        # Seen: up to ~3 ulps (log-sum-exp merges, bands of keys).
        assert_close_to_scale(out, expected.detach()[..., split.local, :], ulps=16)
        out.backward(grad[..., split.local, :])
        grads[0][..., split.local, :] += local.grad
        grads[1] += keys.grad
        grads[2] += values.grad
    for got, tensor in zip(grads, (q, k, v)):
        # As above, and the keys' and values' gradients summed over ranks: up to ~8 ulps seen.
        assert_close_to_scale(got, tensor.grad, ulps=32)


@pytest.mark.parametrize("kernel", ["cpu_flash", "lower_right"])
@pytest.mark.parametrize(("ranks", "balanced"), [(2, True), (2, False), (4, True)])
def test_chunked_causal_attention_equals_one_process_in_value_and_gradient(
        kernel: str, ranks: int, balanced: bool) -> None:
    """Each rank's chunks of queries over the whole sequence's keys, as the CPU path
    (flash kernel blocks merged by log-sum-exp) and the CUDA path (lower-right causal bias)
    compute them: the outputs and the gradients summed over ranks equal one causal SDPA."""
    def attend(local: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
               split: SequenceSplit) -> torch.Tensor:
        args = (local, keys, values, split.starts, split.chunk)
        return _CausalChunks.apply(*args, None) if kernel == "cpu_flash" \
            else lower_right_chunks(*args)

    assert_split_attention_is_one_sdpa(ranks, balanced, 3, 4, None, attend)


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


@pytest.mark.parametrize("window", [2, 3, 4, 6, 12])
@pytest.mark.parametrize(("ranks", "balanced"), [(2, True), (2, False), (4, True)])
def test_windowed_attention_equals_one_process_in_value_and_gradient(
        ranks: int, balanced: bool, window: int) -> None:
    """Each rank's chunks of queries through their bands of the whole sequence's keys: the
    outputs and the gradients summed over ranks equal one SDPA under transformers' sliding
    window mask (a query at p sees the keys p - window < k <= p), for windows shorter than
    a chunk, than a rank's part, and than the sequence."""
    position = torch.arange(16)
    mask = (position[None] <= position[:, None]) & (position[None] > position[:, None] - window)
    assert_split_attention_is_one_sdpa(
        ranks, balanced, 4, 8, mask,
        lambda local, keys, values, split: window_chunks(local, keys, values, split, window))


@pytest.mark.distributed
@pytest.mark.parametrize("model", WINDOWS)
def test_sliding_window_decoders_train_as_one_process(results: dict[str, Any],
                                                      model: str) -> None:
    """transformers Mistral (windows of 12, 6 and 3 over 16 tokens: longer than a rank's 8,
    shorter than it, shorter than a balanced chunk of 4) and Qwen2 (a full layer, then a
    window of 6) fine-tuned at cp=2 end at one process's weights: the window is applied by
    global position over the gathered keys."""
    got, expected = results[f"window_{model}_cp2"], results[f"window_{model}_one"]
    assert_weights(got, expected)
    # Float32 losses of scale ~4, summed over the ranks' halves in another order.
    assert_close_to_scale(got["losses"], expected["losses"], ulps=16, dtype=torch.float32)


@pytest.mark.distributed
def test_the_window_changes_what_is_trained(results: dict[str, Any]) -> None:
    """Not vacuous: the same Mistral with another window (12 or 6, the same initial weights)
    trains to weights far apart, so a run that dropped its window could not pass above."""
    one, other = results["window_mistral6_one"], results["window_mistral12_one"]
    for key, tensor in one["initial"].items():
        assert torch.equal(other["initial"][key], tensor), key
    apart = max(float((one["weights"][key] - other["weights"][key]).abs().max())
                for key in one["weights"])
    assert apart > 1e-4


@pytest.mark.distributed
def test_a_padding_mask_is_refused_on_every_rank(results: dict[str, Any]) -> None:
    """Only the rank holding the padded position sees it; both refuse (the run ends with
    this error, not a hang or a closed connection)."""
    assert results["window_padded_cp2"]["error"] == (
        "under context_parallel=2 MistralForCausalLM was called with an attention_mask that "
        "masks 1 positions (padding), but a split sequence attends by position only: pack "
        "the sequences to one length without padding and pass attention_mask=None")


def test_attention_outside_sdpa_is_refused() -> None:
    """An eager (or flash, flex) attention would attend within a rank's part only."""
    with torch.device("meta"):
        model = window_model("mistral6")
    check_attention({"model": model}, 2)  # built with SDPA, transformers' default
    model.config._attn_implementation = "eager"
    with pytest.raises(ValueError) as error:
        check_attention({"model": model}, 2)
    assert str(error.value) == (
        "under context_parallel=2 attention runs through torch's scaled_dot_product_attention "
        "over the whole sequence, but the model 'model' (MistralForCausalLM) uses "
        "attn_implementation='eager', which would attend within this rank's part only: build "
        "it with attn_implementation='sdpa'")
