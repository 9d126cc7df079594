"""The models and data the CPU step benchmarks train, importable without dream_trainer.

The Lightning runner imports this module from its own virtual environment, which has torch
and Lightning but not dream_trainer, so every variant trains exactly the same thing.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

SEED, BATCH, LR = 0, 32, 1e-3
MODELS = ("mlp", "mlp512", "transformer")
_BATCH_SIZES = {"mlp512": 64}


def batch_size(kind: str) -> int:
    """The micro-batch ``kind`` trains on: 64 samples for ``mlp512``, ``BATCH`` otherwise."""
    return _BATCH_SIZES.get(kind, BATCH)


def build_model(kind: str) -> nn.Module:
    """``mlp``: 3 linear layers (64 -> 256 -> 256 -> 10); ``mlp512``: 3 linear layers of width
    512 (the MLP, with batch 64, that the 1.02 step-overhead target was set on);
    ``transformer``: 2 encoder layers over 16 tokens of width 64."""
    if kind == "mlp":
        return nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(),
                             nn.Linear(256, 10))
    if kind == "mlp512":
        return nn.Sequential(nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(),
                             nn.Linear(512, 10))
    if kind == "transformer":
        layer = nn.TransformerEncoderLayer(64, 4, dim_feedforward=128, dropout=0.0,
                                           batch_first=True)
        return nn.Sequential(nn.TransformerEncoder(layer, num_layers=2), nn.Flatten(),
                             nn.Linear(64 * 16, 10))
    raise ValueError(f"unknown model {kind!r}: expected one of {MODELS}")


def dataset(kind: str, samples: int) -> TensorDataset:
    """``samples`` random inputs with random class labels, the same on every call."""
    generator = torch.Generator().manual_seed(1)
    shape = {"mlp": (64,), "mlp512": (512,)}.get(kind, (16, 64))
    return TensorDataset(torch.randn(samples, *shape, generator=generator),
                         torch.randint(0, 10, (samples,), generator=generator))


def init_weights(model: nn.Module) -> None:
    """Seeded initialization from a private generator, so that every variant (built whole, on
    the meta device, or in another framework) starts from the same weights: normal(0, 0.02)
    matrices, zero biases, unit norm scales."""
    generator = torch.Generator().manual_seed(SEED)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() >= 2:
                values = torch.randn(param.shape, generator=generator) * 0.02
                param.copy_(values.to(param.device, param.dtype))
            elif name.endswith("weight"):
                param.fill_(1.0)
            else:
                param.zero_()


def hand_written(kind: str, steps: int) -> tuple[list[float], nn.Module]:
    """(a), the reference: a plain PyTorch loop, with the gradient norm ``step()`` returns.

    Under a process group of several ranks it wraps the model in DDP and reads every
    world-size-th sample, as the trainers' samplers do. Returns each step's seconds (data
    loading excluded) and the unwrapped model.
    """
    ranks = dist.get_world_size() if dist.is_initialized() else 1
    model = build_model(kind)
    init_weights(model)
    batch = batch_size(kind)
    data = dataset(kind, steps * batch * ranks)
    sampler = DistributedSampler(data, shuffle=False) if ranks > 1 else None
    trained = DistributedDataParallel(model) if ranks > 1 else model
    optimizer = torch.optim.AdamW(trained.parameters(), lr=LR)
    times = []
    trained.train()
    for x, y in DataLoader(data, batch_size=batch, sampler=sampler):
        start = time.perf_counter()
        loss = F.cross_entropy(trained(x), y)
        loss.backward()
        torch.nn.utils.get_total_norm([p.grad for p in trained.parameters()], foreach=True)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - start)
    return times, model

