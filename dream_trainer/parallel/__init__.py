"""Parallelism backends and the helpers that make them numerically transparent."""

from dream_trainer.parallel.data_parallel import (DataParallelBackend, DDPBackend,
                                                  FSDPBackend, NoDataParallel, backend_for)
from dream_trainer.parallel.grad_norm import clip_grad_norm

__all__ = ["DDPBackend", "DataParallelBackend", "FSDPBackend", "NoDataParallel", "backend_for",
           "clip_grad_norm"]
