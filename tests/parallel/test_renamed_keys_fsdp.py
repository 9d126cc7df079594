"""A model whose state-dict hook renames keys, under FSDP2 on 2 ranks (the script's checks:
resume bit for bit, ``init_weights_from`` a checkpoint and an export, per-block wrapping)."""

from __future__ import annotations

from pathlib import Path

from tests.helpers.launch import REPO, check, torchrun


def test_renamed_keys_under_fsdp2(tmp_path: Path) -> None:
    result = check(torchrun(REPO / "tests/scripts/renamed_keys_run.py", [str(tmp_path)]))
    assert result.stdout.count("renamed keys ok") == 2
