"""Script: checkpoints written under one layout, resumed under another. Runs several jobs one
after another in this launch and saves (from rank 0) what each recorded to OUT.

Jobs:
    save:LAYOUT           train LAYOUT from scratch to step 4, with a checkpoint at step 2
    resume:SOURCE:TARGET  resume SOURCE's step-2 checkpoint under TARGET and train to step 4

Every job trains the tiny transformer through the step API (the same trainer with and without
a pipeline) with SGD with momentum, a step-decay schedule and EMA, on 8 shuffled sequences per
optimizer step. It records, gathered to full tensors by parameter name: the state at step 2
(a save job: what its checkpoint holds) or right after loading (a resume job), and at the end;
the sample ids every data shard trained on at each step; and the warnings dream_trainer
logged, on each rank.

Usage: layout_matrix.py WORK OUT JOB [JOB ...]
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader, TensorDataset

from dream_trainer.callbacks import EMA, Callback
from dream_trainer.configs import CheckpointParameters, DeviceParameters, TrainingParameters
from dream_trainer.mixins import CheckpointConfigMixin, CheckpointMixin
from dream_trainer.parallel.names import canonical_name
from tests.helpers.launch import save_on_rank_zero
from tests.helpers.transformer import (SEQ, VOCAB, StepAPITrainer, TransformerConfig,
                                       next_token_loss)

GLOBAL_BATCH = 8
SEQUENCES = 64  # 8 steps an epoch: the run stays in its first epoch, resumed mid-epoch
SAVE_STEP, STEPS = 2, 4

LAYOUTS: dict[str, tuple[DeviceParameters, int, int]] = {
    # name: (device parameters, data-parallel degree, processes)
    "single": (DeviceParameters.SINGLE_DEVICE(), 1, 1),
    "ddp": (DeviceParameters.DDP(), 2, 2),
    "fsdp": (DeviceParameters.FSDP(), 2, 2),
    "tp": (DeviceParameters(dp_replicate=1, tensor_parallel=2), 1, 2),
    "pp": (DeviceParameters(dp_replicate=1, pipeline_parallel=2), 1, 2),
    "hsdp": (DeviceParameters.HSDP(dp_shard=2), 4, 4),
    "fsdp_tp": (DeviceParameters(dp_shard=2, tensor_parallel=2), 2, 4),
    "pp_fsdp": (DeviceParameters(dp_replicate=1, pipeline_parallel=2, dp_shard=2), 2, 4),
    "cp": (DeviceParameters(dp_replicate=1, context_parallel=2), 1, 2),
}


class MatrixConfig(TransformerConfig, CheckpointConfigMixin):
    pass


class MatrixTrainer(StepAPITrainer, CheckpointMixin):
    """SGD with momentum rather than Adam: the key projections' biases have a true gradient
    of zero (softmax ignores a shift of every score in a row), and Adam would turn the float
    noise of those gradients, which differs between layouts, into steps of the learning
    rate's size."""

    config: MatrixConfig
    sample_ids: list[int]
    """The ids of the sequences in the current micro-batch."""

    def configure_optimizers(self) -> None:
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=self.config.lr,
                                         momentum=0.9)

    def configure_schedulers(self) -> None:
        self.scheduler = torch.optim.lr_scheduler.StepLR(self.optimizer, step_size=1, gamma=0.8)

    def configure_dataloaders(self) -> tuple[DataLoader[Any], None]:
        generator = torch.Generator().manual_seed(3)
        tokens = torch.randint(0, VOCAB, (SEQUENCES, SEQ + 1), generator=generator)
        return DataLoader(TensorDataset(tokens, torch.arange(SEQUENCES)), shuffle=True,
                          batch_size=self.config.training_parameters.train_batch_size), None

    def training_step(self, batch: Any, batch_idx: int) -> dict[str, Any]:
        tokens, ids = batch
        self.sample_ids = ids.tolist()
        loss = self.forward_backward(self.model, tokens[:, :-1], target=tokens[:, 1:],
                                     loss_fn=next_token_loss)
        return {"loss": loss, "grad_norm": self.step(self.model, self.optimizer)}


def everyone(value: Any) -> list[Any]:
    """``value`` as each rank has it, in rank order (a collective under torchrun)."""
    if not dist.is_initialized():
        return [value]
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, value)
    return gathered


def full(tensor: torch.Tensor) -> torch.Tensor:
    return (tensor.full_tensor() if isinstance(tensor, DTensor) else tensor).detach().clone()


def full_state(trainer: MatrixTrainer, ema: EMA) -> dict[str, Any]:
    """Weights, momenta and EMA averages as full tensors by name, merged from every pipeline
    stage, with the learning rate, scheduler and counters (a collective)."""
    model, optimizer = trainer.model, trainer.optimizer
    params = {canonical_name(model, name): param for name, param in model.named_parameters()}
    mine = {
        "weights": {name: full(param) for name, param in params.items()},
        "momenta": {name: full(optimizer.state[param]["momentum_buffer"])
                    for name, param in params.items()},
        "ema": {key: full(value) for key, value in ema.state_dict().items()
                if isinstance(value, torch.Tensor)},
    }
    merged: dict[str, Any] = {key: {} for key in mine}
    for part in everyone(mine):
        for key, tensors in part.items():
            merged[key].update(tensors)
    return {**merged, "ema_updates": ema.num_updates, "lr": trainer.scheduler.get_last_lr(),
            "scheduler": trainer.scheduler.state_dict(), "global_step": trainer.global_step,
            "epoch": trainer.current_epoch}


class Warnings(logging.Handler):
    """Keeps the messages of dream_trainer's warnings in this process."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


class Recorder(Callback):
    """Records what the module docstring lists; attach it after the EMA callback."""

    def __init__(self, ema: EMA, warnings: Warnings) -> None:
        self.ema, self.warnings = ema, warnings
        self.steps: list[tuple[int, list[int]]] = []
        self.result: dict[str, Any] = {}

    def post_setup(self) -> None:
        # The checkpoint mixin resumes in the trainer's own post_setup, before callbacks'.
        if self.trainer.global_step > 0:
            self.result["loaded"] = full_state(self.trainer, self.ema)

    def post_train_batch(self, result: dict[str, Any], batch_idx: int) -> None:
        trainer = self.trainer
        self.steps.append((trainer.global_step, trainer.sample_ids))
        if trainer.global_step == SAVE_STEP:  # a resumed run starts after it
            self.result["saved"] = full_state(trainer, self.ema)

    def post_fit(self) -> None:
        world = self.trainer.world
        self.result["final"] = full_state(self.trainer, self.ema)
        self.result["samples"] = everyone((world.data_shard, self.steps))
        self.result["warnings"] = everyone(self.warnings.messages)


def config(layout: str, work: Path, experiment: str, resume: Path | None) -> MatrixConfig:
    params, dp, _ = LAYOUTS[layout]
    return MatrixConfig(
        project="matrix", group="tests", experiment=experiment, n_sequences=SEQUENCES,
        device_parameters=params,
        training_parameters=TrainingParameters(n_epochs=1, train_batch_size=GLOBAL_BATCH // dp,
                                               max_steps=STEPS),
        checkpoint_parameters=CheckpointParameters(root_dir=work, every_n_steps=SAVE_STEP,
                                                   every_n_epochs=None, resume=resume))


def run(job: str, work: Path) -> dict[str, Any]:
    kind, *layouts = job.split(":")
    if kind == "save":
        (layout,) = layouts
        trainer = MatrixTrainer(config(layout, work, layout, None))
    else:
        source, layout = layouts
        checkpoint = config(source, work, source, None).run_dir(work) / "checkpoints" \
            / f"step_{SAVE_STEP}"
        trainer = MatrixTrainer(config(layout, work, f"{source}-to-{layout}", checkpoint))
    ema, warnings = EMA(decay=0.5), Warnings()
    recorder = Recorder(ema, warnings)
    trainer.callbacks.append(ema)
    trainer.callbacks.append(recorder)
    trainer.callbacks.attach(trainer)
    logger = logging.getLogger("dream_trainer")
    logger.addHandler(warnings)
    try:
        trainer.fit()
    finally:
        logger.removeHandler(warnings)
    return recorder.result


def main(work: str, out: str, jobs: list[str]) -> None:
    save_on_rank_zero({job: run(job, Path(work)) for job in jobs}, out, "layout_matrix")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3:])
