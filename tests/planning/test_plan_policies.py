"""The planner's activation figures per checkpointing policy and offload setting
(``dream-trainer plan --activation-policies``) against what a real step keeps
(``dream-trainer summarize --activations``, and the independent saved-tensor measurement of
``tests/helpers/saved_activations.py``), on the 4-block rotary GPT of the policy tests.

Tolerance: the issue's 10 %. The plan runs the step on fake tensors; the real step keeps the
same storages, so the two agree to the byte here; the independent helper counts 524 bytes
more: the 544-byte micro-batch it sees through the view forward takes of it, less 20 bytes of
scalars the trainer's step keeps and a bare forward does not make.
"""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch

from dream_trainer.cli import main
from dream_trainer.cli.arguments import policy_overrides
from dream_trainer.parallel.checkpointing import checkpoint_blocks
from dream_trainer.parallel.offload import offload_blocks
from dream_trainer.planning.report import POLICIES
from dream_trainer.planning.saved import SavedActivations, measure_real_step
from dream_trainer.planning.session import sandboxed, set_up, without_callbacks_or_compilation
from dream_trainer.planning.simulate import plan_rank
from tests.helpers.launch import REPO
from tests.helpers.rotary_gpt import RotaryGPT, summed_loss, targets_of
from tests.helpers.saved_activations import saved_activation_bytes
from tests.planning.policies_target import make_trainer
from tests.scripts.activation_policies_run import BLOCKS, GLOBAL_BATCH

TARGET = "tests.planning.policies_target:make_trainer"
PERFORMANCE = REPO / "docs/performance.md"


@pytest.fixture(scope="module")
def planned() -> dict[str, SavedActivations]:
    plans = {label: plan_rank(lambda: make_trainer(policy_overrides(policy, offload)), 1, 0, 1)
             for label, policy, offload in POLICIES}
    assert all(plan.saved is not None for plan in plans.values())
    return {label: plan.saved for label, plan in plans.items()}  # type: ignore[misc]


@pytest.fixture(scope="module")
def stepped() -> dict[str, SavedActivations]:
    saved = {}
    for label, policy, offload in POLICIES:
        trainer = make_trainer(policy_overrides(policy, offload))
        without_callbacks_or_compilation(trainer)
        with sandboxed(trainer), set_up(trainer):
            saved[label] = measure_real_step(trainer)
    return saved


def helper_measured(policy: Any, offload: bool) -> int:
    """Every storage one forward of the same model and batch keeps for backward, by the
    saved-tensor helper (host copies included: on the CPU they are what is kept)."""
    torch.manual_seed(0)
    model = RotaryGPT(BLOCKS)
    checkpoint_blocks(model, policy)
    if offload:
        offload_blocks(model)
    (tokens,) = next(iter(make_trainer([]).configure_dataloaders()[0]))
    assert tokens.shape[0] == GLOBAL_BATCH
    saved, _ = saved_activation_bytes(
        lambda: summed_loss(model(tokens[:, :-1]), targets_of(tokens)),
        [*model.parameters(), *model.buffers()])
    return saved.held


def test_the_plans_estimate_per_policy_is_within_10_percent_of_the_measured_bytes(
        planned: dict[str, SavedActivations], stepped: dict[str, SavedActivations]) -> None:
    for label, policy, offload in POLICIES:
        estimate, real = planned[label], stepped[label]
        assert estimate.device_bytes == pytest.approx(real.device_bytes, rel=0.10), label
        assert estimate.host_bytes == pytest.approx(real.host_bytes, rel=0.10), label
        assert (estimate.host_bytes > 0) == offload, label
        assert estimate.total_bytes == pytest.approx(helper_measured(policy, offload),
                                                     rel=0.10), label
    device = {label: saved.device_bytes for label, saved in planned.items()}
    assert device["none"] > device["selective"] > device["every 2nd block"] > device["full"]
    # Offloading moves what the blocks keep: what stays is what the layers outside them keep.
    assert device["every 2nd block, offloaded"] == device["full, offloaded"] < device["full"]


def test_the_docs_state_the_estimates_and_measurements(
        planned: dict[str, SavedActivations], stepped: dict[str, SavedActivations]) -> None:
    section = PERFORMANCE.read_text().split("### The planner's estimate", 1)[1]
    section = section.split("\n### ", 1)[0]  # this subsection's table only
    rows = re.findall(r"^\| ([\w ,]+?) \| ([\d,]+) \| ([\d,]+) \| ([\d,]+) \| ([\d,]+) \|",
                      section, re.MULTILINE)
    documented = {label: tuple(int(cell.replace(",", "")) for cell in cells)
                  for label, *cells in rows}
    assert documented == {label: (planned[label].device_bytes, planned[label].host_bytes,
                                  stepped[label].device_bytes, stepped[label].host_bytes)
                          for label, _, _ in POLICIES}


def policy_rows(output: str) -> dict[str, list[str]]:
    """The policy table's rows in a command's output: label -> the other cells."""
    lines = output.splitlines()
    start = next(i for i, line in enumerate(lines)
                 if line.startswith("policy ") and "saved for backward" in line)
    labels = sorted((label for label, _, _ in POLICIES), key=len, reverse=True)
    found = {}
    for line in lines[start + 1:start + 1 + len(POLICIES)]:
        label = next(label for label in labels if line.startswith(label))
        found[label] = [cell.strip() for cell in line[len(label):].split("  ") if cell.strip()]
    return found


@pytest.mark.usefixtures("restore_imports")
def test_plan_and_summarize_print_the_same_saved_bytes_side_by_side(
        capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", TARGET, "--world-size", "1", "--activation-policies"]) == 0
    plan_output = capsys.readouterr().out
    assert "activation policies at world size 1, rank 0:" in plan_output
    assert main(["summarize", TARGET, "--activations"]) == 0
    summary = capsys.readouterr().out
    assert "== saved for backward, one real step per activation policy ==" in summary
    planned, measured = policy_rows(plan_output), policy_rows(summary)
    assert list(planned) == list(measured) == [label for label, _, _ in POLICIES]
    for label in planned:
        # saved for backward, on host; the plan adds its peak and total.
        assert planned[label][:2] == measured[label], label
        assert len(planned[label]) == 4 and len(measured[label]) == 2


@pytest.mark.usefixtures("restore_imports")
def test_a_combination_the_config_refuses_is_a_row_with_the_reason(
        capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", TARGET, "--world-size", "1", "--activation-policies", "--",
                 "--device_parameters.compile_model", "true"]) == 0
    output = capsys.readouterr().out
    rows = policy_rows(output)
    assert rows["full"][0] != "not run (below)"
    for label in ("every 2nd block, offloaded", "full, offloaded"):
        assert rows[label] == ["not run (below)"]
        assert f"{label}: refused: activation_offload=True with compile_model=True is not " \
               "supported" in output
