"""DPO against a frozen reference model (tests/scripts/dpo_run.py): one process equals DDP 2,
FSDP2 2, HSDP 4, TP 2 and cp 2 (the reference sharded as the policy is, cp summing each
sequence's log-probs over the ranks with ``sequence_sum``); the reference never changes,
holds no gradient and is in no optimizer; LoRA with the adapter-free base as the reference
equals a separate reference model read from the same weights."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.helpers.launch import REPO, check, torchrun

pytestmark = pytest.mark.distributed

SCRIPT = REPO / "tests/scripts/dpo_run.py"
# SGD steps of one computation with the batch mean taken in another order (data-parallel
# averages, sharded matmuls, cp's summed halves): weights of scale ~0.1 agree to float32
# rounding (measured: 7e-9).
TOLERANCE = 1e-6


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.helpers.hf import save_pretrained

    path = tmp_path_factory.mktemp("dpo_base") / "base"
    save_pretrained("llama", path)
    return path


@pytest.fixture(scope="module")
def single(base: Path) -> dict[str, dict[str, Any]]:
    from tests.scripts.dpo_run import run

    return {layout: run(layout, str(base)) for layout in ("single", "single_lora",
                                                          "single_lorapair")}


def saved_base(base: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(base / "model.safetensors")


def within(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor],
           label: str) -> None:
    assert actual.keys() == expected.keys(), label
    for name, value in expected.items():
        assert (actual[name] - value).abs().max() <= TOLERANCE, (label, name)


def test_dpo_trains_the_policy_and_leaves_the_reference_alone(
        single: dict[str, dict[str, Any]], base: Path) -> None:
    run = single["single"]
    assert run["steps"] == 3
    assert run["optimized"] == 2 * 9 + 3  # every policy weight, no reference weight
    assert run["reference_grads"] == []
    stored = saved_base(base)
    for name, value in run["reference_final"].items():
        # The reference is the saved base, bit for bit, after training.
        assert torch.equal(value, stored[name]), name
    for name, value in run["initial"].items():
        assert torch.equal(value, run["reference_final"][name]), name  # the same start
    moved = max(float((run["final"][name] - value).abs().max())
                for name, value in run["initial"].items())
    assert moved > 1e-3


def test_every_layout_trains_what_one_process_trains(
        tmp_path: Path, base: Path, single: dict[str, dict[str, Any]]) -> None:
    two, four = tmp_path / "two.pt", tmp_path / "four.pt"
    check(torchrun(SCRIPT, [str(two), str(base), "ddp", "fsdp", "tp", "cp", "fsdp_lora"],
                   nproc=2, timeout=500))
    check(torchrun(SCRIPT, [str(four), str(base), "hsdp"], nproc=4, timeout=500))
    runs = {**torch.load(two, weights_only=False), **torch.load(four, weights_only=False)}
    expected = single["single"]
    for layout in ("ddp", "fsdp", "hsdp", "tp", "cp"):
        run = runs[layout]
        assert run["steps"] == 3 and run["optimized"] == expected["optimized"], layout
        within(run["final"], expected["final"], layout)
        assert run["reference_grads"] == [], layout
        for name, value in expected["reference_final"].items():
            assert torch.equal(run["reference_final"][name], value), (layout, name)
        # Sharded as the policy is (each rank holds a part), or split by TP.
        assert run["reference_sharded"] == (layout in ("fsdp", "hsdp", "tp", "cp")), layout
    lora = runs["fsdp_lora"]
    within(lora["final"], single["single_lora"]["final"], "fsdp_lora")


def test_lora_with_the_base_as_reference_equals_a_separate_reference(
        single: dict[str, dict[str, Any]]) -> None:
    lora, pair = single["single_lora"], single["single_lorapair"]
    assert lora["optimized"] == pair["optimized"] == 2 * 7 * 2  # the adapters only
    within(lora["final"], pair["final"], "lora against the pair")
    moved = max(float((lora["final"][name] - value).abs().max())
                for name, value in lora["initial"].items())
    assert moved > 1e-3


def test_a_changed_reference_table_is_refused_and_a_trainable_model_too(
        tmp_path: Path, base: Path) -> None:
    import shutil

    from torch.utils.data import default_collate

    from dream_trainer.callbacks import ReferenceLogProbs
    from dream_trainer.errors import CheckpointError
    from tests.scripts.dpo_resume import DPOResume
    from tests.scripts.dpo_run import attach_precomputed, pair_dataset, pair_log_probs
    from tests.scripts.lora_resume import config

    sources = {"model": base, "reference": base}
    first = DPOResume(config(sources, tmp_path, tmp_path / "first"))
    attach_precomputed(first)
    first.fit()
    assert first.precomputed is not None and first.precomputed.computed
    # Released: the reference's parameters hold no storage while the policy trains.
    assert all(param.untyped_storage().size() == 0 for param in first.reference.parameters())
    assert first.precomputed.lookup(torch.tensor([2, 0])).shape == (2, 2)
    checkpoints = tmp_path / "hf/tests/llama/checkpoints"
    shutil.rmtree(checkpoints / "step_3")  # resume from step 2
    table = checkpoints / "reference_log_probs" / "reference.safetensors"
    data = bytearray(table.read_bytes())
    data[-1] ^= 1  # one bit of the last value
    table.write_bytes(bytes(data))
    again = DPOResume(config(sources, tmp_path, tmp_path / "again"))
    attach_precomputed(again)
    with pytest.raises(CheckpointError) as error:
        again.fit()
    assert str(error.value).startswith(
        f"{table} does not match {table.with_suffix('.json')} (its checksum, or 24 items)")

    policy = ReferenceLogProbs("model", pair_dataset(), default_collate, pair_log_probs)
    with pytest.raises(RuntimeError, match="lookup before the pass"):
        policy.lookup(torch.tensor([0]))
    trainer = DPOResume(config(sources, tmp_path / "policy", tmp_path / "policy"))
    trainer.callbacks.append(policy)
    trainer.callbacks.attach(trainer)
    with pytest.raises(ValueError, match=r"ReferenceLogProbs\('model'\): the model has "
                                         "trainable parameters"):
        trainer.fit()
