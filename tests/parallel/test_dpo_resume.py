"""A SIGKILLed DPO run (FSDP2, 2 ranks, policy and frozen reference read from one base, the
reference's log-probs computed once before the first step by ``ReferenceLogProbs`` and its
storage freed) resumes bit for bit, reading the table kept beside the checkpoints; the
checkpoints hold no copy of the reference's weights, they record its source instead
(``models.json``); and the run trains what computing the log-probs at every step trains."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.helpers.launch import REPO, check, torchrun
from tests.helpers.checkpointing import assert_same_weights as assert_same
from tests.parallel.test_lora_resume import CHECKPOINTS

pytestmark = pytest.mark.distributed

SCRIPT = REPO / "tests/scripts/dpo_resume.py"


def test_a_killed_dpo_run_resumes_bit_exactly_without_the_reference_in_its_checkpoint(
        tmp_path: Path) -> None:
    from dream_trainer.checkpoint.trust import safe_reader
    from tests.helpers.hf import save_pretrained

    base = tmp_path / "base"
    save_pretrained("llama", base)
    markers = tmp_path / "markers"
    markers.mkdir()
    check(torchrun(SCRIPT, [str(base), str(tmp_path / "each"), str(tmp_path / "each")],
                   timeout=300))
    check(torchrun(SCRIPT, [str(base), str(tmp_path / "straight"), str(tmp_path / "straight"),
                            "--precompute"], timeout=300))
    each, once = (torch.load(tmp_path / f"{run}.final") for run in ("each", "straight"))
    assert once["global_step"] == each["global_step"] == 3
    # The same reference forward passes in other batches: float32 rounding at most.
    for name, value in each.items():
        if isinstance(value, torch.Tensor):
            assert (once[name] - value).abs().max() <= 1e-6, name

    killed = torchrun(SCRIPT, [str(base), str(tmp_path / "killed"), str(tmp_path / "killed"),
                               "--precompute", "--kill", "step:3", "--markers", str(markers)],
                      timeout=300)
    assert killed.returncode != 0 and (markers / "step_3").exists()
    step2 = tmp_path / "killed" / CHECKPOINTS / "step_2"
    saved = safe_reader(str(step2)).read_metadata().state_dict_metadata
    assert not any(key.startswith("state.models.reference.") for key in saved)
    assert any(key.startswith("state.models.model.") for key in saved)  # the policy is there
    frozen = json.loads((step2 / "models.json").read_text())["frozen"]
    assert list(frozen) == ["reference"]  # the policy trains: all of it is saved
    assert frozen["reference"]["paths"] == [str(base)]
    assert len(frozen["reference"]["keys"]) == 2 * 9 + 3
    table = tmp_path / "killed" / CHECKPOINTS / "reference_log_probs" / "reference.json"
    written = table.stat().st_mtime_ns
    check(torchrun(SCRIPT, [str(base), str(tmp_path / "killed"), str(tmp_path / "resumed"),
                            "--precompute"], timeout=300))
    assert table.stat().st_mtime_ns == written  # read, not computed again
    straight = {tag: torch.load(tmp_path / f"straight.{tag}") for tag in ("step2", "final")}
    assert_same(torch.load(tmp_path / "resumed.loaded"), straight["step2"])
    assert_same(torch.load(tmp_path / "resumed.final"), straight["final"])
