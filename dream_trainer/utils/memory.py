"""Memory figures for progress displays and logs: CUDA allocator peaks and process RSS."""

from __future__ import annotations

import os
import sys
import weakref

import torch

GIB = 2**30


def process_rss_bytes() -> int | None:
    """This process's resident set size in bytes; None where it cannot be read.

    Linux reads the current value from ``/proc/self/statm``; other POSIX systems report the
    peak so far (``getrusage``), the only figure they offer without a dependency.
    """
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        pass
    try:
        import resource
    except ImportError:  # Windows
        return None
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)  # bytes on macOS, else KiB


# Every open window of the process, so that one window's reset of the allocator's peak
# counters is folded into the others first: the allocator keeps a single peak per device.
_WINDOWS: weakref.WeakSet[CudaPeakWindow] = weakref.WeakSet()


class CudaPeakWindow:
    """Peak CUDA memory allocated and reserved on ``device`` since this window's last
    ``read()``, correct when several windows (a progress bar and a throughput logger) share
    the device's peak counters.

    Args:
        device: A CUDA device.
    """

    def __init__(self, device: torch.device) -> None:
        # "cuda" and "cuda:0" name one counter: windows compare indexed devices.
        index = torch.cuda.current_device() if device.index is None else device.index
        self.device = torch.device("cuda", index)
        self._allocated = torch.cuda.memory_allocated(device)
        self._reserved = torch.cuda.memory_reserved(device)
        _WINDOWS.add(self)

    def peek(self) -> tuple[int, int]:
        """``(allocated, reserved)`` peaks in bytes so far in this window; no reset."""
        return (max(self._allocated, torch.cuda.max_memory_allocated(self.device)),
                max(self._reserved, torch.cuda.max_memory_reserved(self.device)))

    def read(self) -> tuple[int, int]:
        """``(allocated, reserved)`` peaks in bytes of this window, then start a new one."""
        for window in list(_WINDOWS):
            if window.device == self.device:
                window._allocated, window._reserved = window.peek()
        peaks = self._allocated, self._reserved
        torch.cuda.reset_peak_memory_stats(self.device)
        self._allocated = torch.cuda.memory_allocated(self.device)
        self._reserved = torch.cuda.memory_reserved(self.device)
        return peaks
