"""Two torchrun agents (two "nodes" of one process each) train together."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.helpers.launch import REPO, check, torchrun_nodes


@pytest.mark.distributed
def test_two_node_launch_trains_like_one_ddp_group(tmp_path: Path) -> None:
    out = tmp_path / "result.pt"
    for result in torchrun_nodes(REPO / "tests/scripts/ddp_parity.py", [str(out)]):
        check(result)
    result = torch.load(out)
    assert result["global_step"] == 10
    for name, tensor in result["reference"].items():
        assert torch.equal(result["trainer"][name], tensor), name
    for name, tensor in result["trainer"].items():
        assert torch.equal(result["rank1_trainer"][name], tensor), name
