"""One replica group of a fault-tolerant run (or, with --mode ddp, the same training as DDP).

Run under torchrun, one launch per replica group. Rank 0 appends one JSON line per optimizer
step to OUT/replica_<id>.jsonl (global and committed steps, quorum size, recoveries, its pid);
every rank writes its pid to OUT/pid_<id>_<rank> at setup, and the addresses its process
listens on (and the class of its manager's checkpoint transport) to
OUT/listeners_<id>_<rank>.json once a step has committed with another group (every listener
then exists); after training rank 0 saves the full model weights to
OUT/weights_<id>.pt. Training goes on until the number written to
--stop-file (once it exists) or --max-steps optimizer steps. A worker that torchrun restarted
waits for --restart-gate (once given) to exist before it starts again.
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import os
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from dream_trainer import BaseTrainer, BaseTrainerConfig, StopTraining
from dream_trainer.callbacks import Callback, NanGuard, ProgressBar
from dream_trainer.configs import (CheckpointParameters, DeviceParameters,
                                   FaultToleranceParameters, LoggingParameters, TrainingParameters)
from dream_trainer.mixins import (CheckpointConfigMixin, CheckpointMixin, FaultTolerantConfigMixin,
                                  FaultTolerantMixin, JSONLoggerConfigMixin, JSONLoggerMixin,
                                  SetupConfigMixin, SetupMixin)
from dream_trainer.parallel.dtensor import is_dtensor


class RunConfig(BaseTrainerConfig, SetupConfigMixin):
    out: Path
    stop_file: Path | None = None
    step_delay: float = 0.0
    optimizer: str = "adamw"
    weighting: bool = False


class FTRunConfig(RunConfig, FaultTolerantConfigMixin, CheckpointConfigMixin,
                  JSONLoggerConfigMixin):
    pass


class Blocks(nn.Module):
    """Two blocks in a ModuleList, so that FSDP2 shards each block and the root."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(8, 32), nn.Linear(32, 4)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers[1](torch.tanh(self.layers[0](x)))


def listening_sockets(pid: int | str = "self") -> list[tuple[str, int]]:
    """The (address, port) of every TCP socket that process ``pid`` listens on, from /proc:
    the sockets of its network namespace in LISTEN state whose inode it holds open."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:["):-1])
    found = []
    for table in ("tcp", "tcp6"):
        for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] != "0A" or fields[9] not in inodes:  # 0A: LISTEN
                continue
            address, port = fields[1].split(":")
            # /proc writes each 32-bit word of the address in the host's (little-endian)
            # byte order.
            raw = b"".join(bytes.fromhex(address[i:i + 8])[::-1]
                           for i in range(0, len(address), 8))
            found.append((str(ipaddress.ip_address(raw)), int(port, 16)))
    return sorted(found)


class Steps(Callback[BaseTrainer]):
    """Records each optimizer step and stops when the stop file says so."""

    def __init__(self, record: Path | None, stop_file: Path | None, out: Path) -> None:
        self.record, self.stop_file, self.out = record, stop_file, out
        self.stop_at: int | None = None
        self.reported = False

    def post_train_batch(self, result: dict[str, Any], batch_idx: int) -> None:
        trainer = self.trainer
        if trainer.is_accumulating_gradients:
            return
        if isinstance(trainer, FaultTolerantMixin) and not self.reported \
                and trainer.last_step_committed and trainer.replica_participants > 1:
            self.reported = True
            name = f"listeners_{trainer.replica_id}_{trainer.world.rank}.json"
            transport = trainer._replica_group.manager._checkpoint_transport
            (self.out / name).write_text(json.dumps(
                {"listening": listening_sockets(), "transport": type(transport).__name__}))
        if self.record is not None and trainer.world.is_rank_zero:
            entry = {"global_step": trainer.global_step, "pid": os.getpid(),
                     "loss": float(result["loss"].detach()), "time": time.time()}
            if isinstance(trainer, FaultTolerantMixin):
                entry.update(committed=trainer.last_step_committed,
                             committed_steps=trainer.committed_steps,
                             not_committed=trainer.update_vote.skipped.get("fault_tolerance", 0),
                             participants=trainer.replica_participants,
                             recoveries=trainer.recoveries)
            with self.record.open("a") as file:
                file.write(json.dumps(entry) + "\n")
        if self.stop_at is None and self.stop_file is not None and self.stop_file.exists():
            self.stop_at = int(self.stop_file.read_text())
            if trainer.global_step > self.stop_at:
                # Stopping later than the other groups would end with other weights.
                raise RuntimeError(f"step {trainer.global_step} is already past the stop step "
                                   f"{self.stop_at}: the test chose too small a margin")
        if self.stop_at is not None and trainer.global_step >= self.stop_at:
            raise StopTraining(f"the test asked to stop at step {self.stop_at}")


class Trainer(BaseTrainer, SetupMixin):
    config: RunConfig

    def configure_models(self) -> None:
        self.model = Blocks()

    def configure_optimizers(self) -> None:
        if self.config.optimizer == "sgd":
            self.optimizer: torch.optim.Optimizer = torch.optim.SGD(
                self.model.parameters(), lr=0.05, momentum=0.9)
        else:
            self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-2)

    def configure_schedulers(self) -> None:
        self.scheduler = torch.optim.lr_scheduler.StepLR(self.optimizer, step_size=5, gamma=0.9)

    def configure_dataloaders(self) -> tuple[DataLoader[Any], None]:
        generator = torch.Generator().manual_seed(0)
        x = torch.randn(512, 8, generator=generator)
        y = torch.randn(512, 4, generator=generator)
        batch = self.config.training_parameters.train_batch_size
        return DataLoader(TensorDataset(x, y), batch_size=batch, shuffle=True), None

    def training_step(self, batch: Any, batch_idx: int) -> dict[str, Any]:
        if self.config.step_delay:
            time.sleep(self.config.step_delay)
        x, y = batch
        per_sample = F.mse_loss(self.model(x), y, reduction="none").mean(dim=1)
        if self.config.weighting and self.global_step % 2:
            # Token-weighted steps (every other one): a data-dependent number of items per
            # batch and rank, summed over the groups by the fault-tolerant reduction.
            keep = y[:, 0] > -0.5
            items = keep.sum()
            self.backward((per_sample * keep).sum(), num_items=items)
            loss = (per_sample * keep).sum() / items.clamp_min(1)
        else:
            loss = per_sample.mean()
            self.backward(loss)
        if not self.is_accumulating_gradients:
            self.step(self.model, self.optimizer)
        return {"loss": loss}

    def validation_step(self, batch: Any, batch_idx: int) -> dict[str, Any]:
        return {}

    def post_fit(self) -> None:
        super().post_fit()
        # Gathered while the process group is up: under FSDP2 every rank takes part.
        weights = {name: tensor.full_tensor() if is_dtensor(tensor) else tensor.clone()
                   for name, tensor in self.model.state_dict().items()}
        if self.world.is_rank_zero:
            torch.save(weights, self.config.out / f"weights_{self._name()}.pt")

    def post_setup(self) -> None:
        super().post_setup()
        (self.config.out / f"pid_{self._name()}_{self.world.rank}").write_text(str(os.getpid()))

    def _name(self) -> str:
        return "ddp"


class FTTrainer(FaultTolerantMixin, Trainer, CheckpointMixin, JSONLoggerMixin):
    config: FTRunConfig

    def _name(self) -> str:
        return str(self.replica_id)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", choices=("ft", "ddp"), default="ft")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--replica-id", type=int, default=0)
    parser.add_argument("--groups", type=int, default=1)
    parser.add_argument("--min-replicas", type=int, default=1)
    parser.add_argument("--lighthouse", default="http://localhost:29510")
    parser.add_argument("--dp-shard", type=int, default=1)
    parser.add_argument("--max-steps", type=int, default=10_000)
    parser.add_argument("--stop-file", type=Path, default=None)
    parser.add_argument("--step-delay", type=float, default=0.0)
    parser.add_argument("--optimizer", default="adamw")
    parser.add_argument("--connect-timeout", type=float, default=30.0)
    parser.add_argument("--callbacks", action="store_true",
                        help="add a progress bar and a NaN guard (composition check)")
    parser.add_argument("--weighting", action="store_true",
                        help="make every other step token-weighted (backward with num_items)")
    parser.add_argument("--checkpoint", action="store_true",
                        help="checkpoint at the end and resume from the latest checkpoint")
    parser.add_argument("--restart-gate", type=Path, default=None,
                        help="a restarted worker waits for this file before it starts")
    args = parser.parse_args()
    if args.restart_gate is not None and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
        deadline = time.monotonic() + 300
        while not args.restart_gate.exists():
            if time.monotonic() > deadline:
                raise SystemExit(f"{args.restart_gate} did not appear within 300 s")
            time.sleep(0.05)
    record = args.out / (f"replica_{args.replica_id}.jsonl" if args.mode == "ft" else "ddp.jsonl")
    callbacks: list[Callback[Any]] = [Steps(record, args.stop_file, args.out)]
    if args.callbacks:
        callbacks += [ProgressBar(), NanGuard(mode="skip")]
    device = (DeviceParameters.FSDP() if args.dp_shard > 1 else DeviceParameters.DDP())
    common: dict[str, Any] = dict(
        project="ft", group="tests", experiment="run", out=args.out, stop_file=args.stop_file,
        step_delay=args.step_delay, optimizer=args.optimizer, weighting=args.weighting,
        device_parameters=device,
        callbacks=callbacks,
        training_parameters=TrainingParameters(n_epochs=1000, train_batch_size=4,
                                               max_steps=args.max_steps))
    if args.mode == "ddp":
        Trainer(RunConfig(**common)).fit()
        return
    config = FTRunConfig(
        **common,
        logging_parameters=LoggingParameters(log_dir=args.out / "logs", log_every_n_steps=1),
        checkpoint_parameters=CheckpointParameters(
            enabled=args.checkpoint, root_dir=args.out / "checkpoints", every_n_epochs=None,
            resume="latest" if args.checkpoint else None),
        fault_tolerance_parameters=FaultToleranceParameters(
            lighthouse=args.lighthouse, replica_id=args.replica_id, replica_groups=args.groups,
            min_replicas=args.min_replicas, timeout=timedelta(seconds=20),
            quorum_timeout=timedelta(seconds=60),
            connect_timeout=timedelta(seconds=args.connect_timeout)))
    FTTrainer(config).fit()


if __name__ == "__main__":
    main()
