"""Which device a world drives: CUDA, MPS (Apple silicon) or the CPU, with torch's reports of
what the machine has monkeypatched (this machine has neither CUDA nor MPS)."""

from __future__ import annotations

import re
from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist
from pydantic import ValidationError

from dream_trainer.configs import DeviceParameters
from dream_trainer.world import DistributedWorld, LaunchEnvironment

ONE = LaunchEnvironment()
TWO = LaunchEnvironment(rank=1, local_rank=1, world_size=2, local_world_size=2, launched=True)


@pytest.fixture
def machine(monkeypatch: pytest.MonkeyPatch) -> Callable[..., None]:
    """Set what torch reports: ``machine(cuda=..., mps=...)``."""
    def set_up(cuda: bool, mps: bool) -> None:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: 2 if cuda else 0)
        monkeypatch.setattr(torch.backends.mps, "is_available", lambda: mps)
    return set_up


def test_the_config_accepts_mps_and_refuses_other_names() -> None:
    assert DeviceParameters(device="mps").device == "mps"
    with pytest.raises(ValidationError, match="device"):
        DeviceParameters(device="metal")


@pytest.mark.parametrize(("cuda", "mps", "env", "expected"), [
    (False, True, ONE, torch.device("mps")),    # a Mac: auto picks MPS
    (False, True, TWO, torch.device("cpu")),    # several processes cannot share MPS tensors
    (True, True, TWO, torch.device("cuda", 1)),  # CUDA first, by local rank
    (False, False, ONE, torch.device("cpu")),
])
def test_auto_picks_cuda_then_mps_then_the_cpu(machine: Callable[..., None], cuda: bool, mps: bool,
                                               env: LaunchEnvironment,
                                               expected: torch.device) -> None:
    machine(cuda=cuda, mps=mps)
    assert DistributedWorld(DeviceParameters(device="auto"), env=env).device == expected


def test_mps_runs_on_gloo_in_one_process(machine: Callable[..., None]) -> None:
    machine(cuda=False, mps=True)
    world = DistributedWorld(DeviceParameters(device="mps"), env=ONE)
    assert world.device == torch.device("mps") and world.backend == "gloo"
    world.launch()  # creates no tensor on the device: the group and no mesh (one rank)
    try:
        assert dist.get_backend() == "gloo" and world.mesh is None
    finally:
        world.shutdown()


def test_mps_asked_for_but_missing_or_shared_is_a_clear_error(machine: Callable[..., None]) -> None:
    machine(cuda=False, mps=False)
    with pytest.raises(ValueError, match=re.escape(
            "device='mps' but torch reports no MPS device (torch.backends.mps.is_available() "
            "is False: it needs Apple silicon and a torch built with MPS): use 'auto' or "
            "'cpu'")):
        DistributedWorld(DeviceParameters(device="mps"), env=ONE)
    machine(cuda=False, mps=True)
    with pytest.raises(ValueError, match=re.escape(
            "device='mps' runs one process, but the world has 2: gloo cannot move MPS tensors "
            "between processes. Run `python train.py` without torchrun, or use device='cpu' "
            "(or 'auto', which picks the CPU for several processes)")):
        DistributedWorld(DeviceParameters(device="mps"), env=TWO)
