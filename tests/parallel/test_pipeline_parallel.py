"""Pipeline parallelism against one process: every schedule, and with FSDP2, TP and loss_parallel.

One trainer class (``training_step`` through ``forward_backward``) trains the tiny transformer
for 3 optimizer steps of 16 sequences, 2 accumulated micro-batches each, with clipping, in
every layout: one process, each of torch's 7 schedules on 2 ranks, pp2 x dp_shard2, pp2 x tp2
and pp2 x tp2 with loss_parallel on 4 ranks, pp2 x dp_shard2 x tp2 and pp2 x HSDP (2 replicas
of 2 shards) on 8. Every second
micro-batch is 2 tokens shorter, so each pipeline builds a second schedule inside an
accumulation window.

Tolerance: float32 results must agree with the single process to 16 ulps of their scale
(tests/helpers/tolerance.py). A pipeline adds the microbatches' gradients (and sums their
losses, and combines the stages' norms) in a different order than one process, which moves
float32 rounding by ~1e-8 in the weights and ~5e-7 in the losses, a few ulps; a wrong scale
(the scale_grads=True trap, a missing accumulation term) moves the weights by ~1e-3 and the
gradient norm by ~0.15.
"""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import pytest
import torch

from tests.helpers.launch import REPO, check, child_env, torchrun
from tests.helpers.tolerance import assert_close_to_scale, assert_tensors_close_to_scale

pytestmark = pytest.mark.distributed

SCRIPT = REPO / "tests/scripts/pipeline_runs.py"
SCHEDULES = ["GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble",
             "ZBVZeroBubble", "DualPipeV"]
COMPOSED = ["pp2_fsdp2", "pp2_tp2", "pp2_tp2_loss_parallel", "pp2_fsdp2_tp2", "pp2_hsdp"]
ULPS = 16


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    out = tmp_path_factory.mktemp("pipeline")
    check(subprocess.run([sys.executable, str(SCRIPT), str(out / "one.pt"), "single",
                          "single_drawn_init", "staged_single"],
                         env=child_env(), cwd=REPO, capture_output=True, text=True,
                         timeout=300))
    # naive_scale_grads patches torch for the rest of its process: it runs last.
    check(torchrun(SCRIPT, [str(out / "two.pt"), *SCHEDULES, "tp2_loss_parallel",
                            "1F1B_drawn_init", "staged_fsdp2", "staged_1F1B",
                            "backward_error", "naive_scale_grads"],
                   nproc=2, timeout=400))
    check(torchrun(SCRIPT, [str(out / "four.pt"), "pp2_fsdp2", "pp2_tp2",
                            "pp2_tp2_loss_parallel", "ddp_error"], nproc=4, timeout=400))
    check(torchrun(SCRIPT, [str(out / "eight.pt"), "pp2_fsdp2_tp2", "pp2_hsdp"], nproc=8,
                   timeout=400))
    merged: dict[str, dict[str, Any]] = {}
    for name in ("one", "two", "four", "eight"):
        merged.update(torch.load(out / f"{name}.pt"))
    return merged


def weight_error(run: dict[str, Any], reference: dict[str, Any]) -> float:
    assert run["final"].keys() == reference["final"].keys()
    return max(float((run["final"][name] - tensor).abs().max())
               for name, tensor in reference["final"].items())


def assert_matches(run: dict[str, Any], reference: dict[str, Any], same_data: bool) -> None:
    """Weights, gradient norms, validation loss and accuracy as one process; the training
    losses too when each rank's micro-batch is the one process's (no data parallelism)."""
    assert run["global_step"] == reference["global_step"] == 3
    assert_tensors_close_to_scale(run["final"], reference["final"], ulps=ULPS)
    for key in ("grad_norms", "val_losses"):
        assert_close_to_scale(run[key], reference[key], ulps=ULPS, dtype=torch.float32, msg=key)
    assert run["val_accuracy"] == reference["val_accuracy"]
    if same_data:
        assert_close_to_scale(run["losses"], reference["losses"], ulps=ULPS,
                              dtype=torch.float32, msg="losses")


def test_the_reference_run_clips_and_moves(results: dict[str, Any]) -> None:
    single = results["single"]
    # Every step's norm is above the clip value, so every step tests the pipeline-wide norm.
    assert min(single["grad_norms"]) > 0.5
    moved = (single["final"]["head.weight"] - single["initial"]["head.weight"]).abs().max()
    assert moved > 1e-3
    assert single["model_type"] == "TinyTransformer"


@pytest.mark.parametrize("mode", [*SCHEDULES, *COMPOSED, "tp2_loss_parallel"])
def test_initial_weights_are_the_one_process_weights(results: dict[str, Any], mode: str) -> None:
    reference = results["single"]["initial"]
    assert results[mode]["initial"].keys() == reference.keys()
    for name, tensor in reference.items():
        assert torch.equal(results[mode]["initial"][name], tensor), (mode, name)


def test_the_users_own_random_init_gives_one_process_weights(results: dict[str, Any]) -> None:
    # init_weights() draws in every block: run on this rank's stages alone it would consume
    # the generator differently (the second stage ended 0.35 away after 4 steps). Under a
    # pipeline it runs once on the whole model, as in one process.
    single, pipelined = results["single_drawn_init"], results["1F1B_drawn_init"]
    assert single["initial"].keys() == pipelined["initial"].keys()
    for name, tensor in single["initial"].items():
        assert torch.equal(pipelined["initial"][name], tensor), name
    # Not the default replay's weights: the user's draws took effect.
    assert not torch.equal(single["initial"]["head.weight"],
                           results["single"]["initial"]["head.weight"])
    assert_matches(pipelined, single, same_data=True)


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_every_schedule_with_accumulation_matches_one_process(results: dict[str, Any],
                                                              schedule: str) -> None:
    assert results[schedule]["model_type"] == "PipelineStages"
    assert_matches(results[schedule], results["single"], same_data=True)


@pytest.mark.parametrize("mode", ["single", "1F1B", "pp2_fsdp2_tp2"])
def test_throughput_counts_the_global_batch_under_a_pipeline(results: dict[str, Any],
                                                           mode: str) -> None:
    # 16 sequences per optimizer step in every layout; a pipeline's ranks are not replicas.
    latest = results[mode]["throughput"]
    samples = latest["throughput/samples_per_second"] * latest["throughput/step_time"]
    assert samples == pytest.approx(16)


def test_a_pipeline_validates_after_fit_as_it_did_at_the_end_of_fit(
        results: dict[str, Any]) -> None:
    pipeline = results["1F1B"]
    assert pipeline["after_fit_val_loss"] == pipeline["val_losses"][-1]


def test_torchs_default_scale_grads_would_fail_these_comparisons(results: dict[str, Any]) -> None:
    # scale_grads=True divides every gradient by the microbatch count at each schedule step,
    # including those accumulated by earlier micro-batches of the window (torchtitan#1732).
    naive, single = results["naive_scale_grads"], results["single"]
    assert weight_error(naive, single) > 1e-4
    # (In the first window the second micro-batch builds a new schedule, before which the
    # first one's gradients are set aside: the trap shows from the second step on.)
    assert max(abs(a - b) for a, b in zip(naive["grad_norms"], single["grad_norms"])) > 0.05


@pytest.mark.parametrize("mode", COMPOSED)
def test_pipeline_with_fsdp2_and_tensor_parallel_matches_one_process(results: dict[str, Any],
                                                                     mode: str) -> None:
    assert results[mode]["model_type"] == "PipelineStages"
    # With data parallelism (2 shards, or 2 replicas of 2) each rank's micro-batch is a part
    # of the one process's.
    assert_matches(results[mode], results["single"],
                   same_data="fsdp2" not in mode and "hsdp" not in mode)


@pytest.mark.parametrize("mode", ["tp2_loss_parallel", "pp2_tp2_loss_parallel"])
def test_loss_parallel_equals_the_gathered_cross_entropy(results: dict[str, Any],
                                                         mode: str) -> None:
    # The loss function received logits sharded on the vocabulary (never gathered) ...
    assert results[mode]["logit_placements"] and all(
        placements == ["S(2)"] for placements in results[mode]["logit_placements"])
    # ... and trained exactly as one process computing cross-entropy on whole logits.
    assert_matches(results[mode], results["single"], same_data=True)


def test_one_training_step_source_runs_with_and_without_a_pipeline(
        results: dict[str, Any]) -> None:
    ran = {results[mode]["training_step"] for mode in ["single", *SCHEDULES, "pp2_fsdp2"]}
    assert ran == {"StepAPITrainer.training_step"}


def test_backward_under_a_pipeline_points_to_forward_backward(results: dict[str, Any]) -> None:
    error = results["backward_error"]["error"]
    assert error is not None and "backward() cannot run under pipeline_parallel > 1" in error
    assert "self.forward_backward(self.model, x, target=y, loss_fn=loss_fn)" in error


def test_ddp_replicas_of_stages_are_refused_once_resolved(results: dict[str, Any]) -> None:
    # 4 ranks, 2 stages, dp_replicate="auto": DDP replicas, which torch's stages cannot run.
    error = results["ddp_error"]["error"]
    assert error is not None and "pipeline_parallel=2 with dp_replicate=2 would wrap" in error
    assert "dp_replicate=1 and dp_shard='auto'" in error
    assert error.endswith("(dp_replicate='auto' is 2 on 4 ranks)")  # by ParallelDims.resolve


def test_a_users_stages_run_in_order_at_their_points_in_every_layout(
        results: dict[str, Any]) -> None:
    one_step = ["pre_optimizer_step", "after_backward", "vote", "after_update",
                "post_optimizer_step"]
    staged = results["staged_single"]
    assert staged["events"] == one_step * 3
    # The gradients the stage changed are the ones measured, clipped and applied ...
    assert weight_error(staged, results["single"]) > 1e-4
    assert max(abs(a - b) for a, b in zip(staged["grad_norms"],
                                          results["single"]["grad_norms"])) > 1e-4
    # ... in one process, under FSDP2 and under a pipeline alike.
    for mode in ("staged_fsdp2", "staged_1F1B"):
        assert results[mode]["events"] == one_step * 3, mode
        assert_matches(results[mode], staged, same_data=mode == "staged_1F1B")

