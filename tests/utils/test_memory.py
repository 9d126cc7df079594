"""Memory figures: CUDA peak windows that share one allocator, and the process RSS."""

from __future__ import annotations

import os

import pytest
import torch

from dream_trainer.utils import memory
from dream_trainer.utils.memory import CudaPeakWindow, process_rss_bytes


class FakeAllocator:
    """The allocator's counters as torch.cuda reports them: current use and one peak."""

    def __init__(self) -> None:
        self.current = self.peak = 0

    def use(self, nbytes: int) -> None:
        self.current = nbytes
        self.peak = max(self.peak, nbytes)

    def reset(self, device: object = None) -> None:
        self.peak = self.current


@pytest.fixture
def allocator(monkeypatch: pytest.MonkeyPatch) -> FakeAllocator:
    fake = FakeAllocator()
    for name in ("memory_allocated", "memory_reserved"):
        monkeypatch.setattr(torch.cuda, name, lambda device=None: fake.current)
    for name in ("max_memory_allocated", "max_memory_reserved"):
        monkeypatch.setattr(torch.cuda, name, lambda device=None: fake.peak)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", fake.reset)
    return fake


def test_each_window_sees_its_own_peak_when_another_resets(allocator: FakeAllocator) -> None:
    device = torch.device("cuda", 0)
    bar, logger = CudaPeakWindow(device), CudaPeakWindow(device)
    allocator.use(100)
    allocator.use(10)
    assert bar.read() == (100, 100)  # resets the allocator's peak to 10
    allocator.use(50)
    allocator.use(20)
    assert bar.read() == (50, 50)
    # The logger's window spans both of the bar's: its peak is the larger one, 100.
    assert logger.peek() == (100, 100)
    assert logger.read() == (100, 100)
    allocator.use(30)
    assert logger.read() == (30, 30)
    assert bar.read() == (30, 30)


def test_a_device_named_without_its_index_shares_the_indexed_counter(
        allocator: FakeAllocator, monkeypatch: pytest.MonkeyPatch) -> None:
    # A benchmark opened a window on "cuda" while the trainer's callbacks read theirs on
    # "cuda:0"; the two were not folded, and the benchmark's peak was the last window's alone
    # (12.09 GiB instead of 39.53 on an H200).
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    outer, callback = CudaPeakWindow(torch.device("cuda")), CudaPeakWindow(torch.device("cuda", 0))
    assert outer.device == callback.device == torch.device("cuda", 0)
    allocator.use(100)
    allocator.use(10)
    assert callback.read() == (100, 100)
    allocator.use(40)
    assert outer.peek() == (100, 100)


def test_windows_of_other_devices_are_left_alone(allocator: FakeAllocator) -> None:
    first = CudaPeakWindow(torch.device("cuda", 0))
    other = CudaPeakWindow(torch.device("cuda", 1))
    allocator.use(70)
    first.read()
    assert other._allocated == 0  # not folded: the fake counters stand for device 0 only
    del other
    assert all(window.device.index != 1 for window in memory._WINDOWS)


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="reads Linux /proc")
def test_rss_grows_with_a_touched_allocation() -> None:
    before = process_rss_bytes()
    block = torch.ones(64 * 2**20, dtype=torch.uint8)  # 64 MiB, written so it is resident
    after = process_rss_bytes()
    assert before is not None and after is not None
    assert after - before >= 48 * 2**20
    del block
