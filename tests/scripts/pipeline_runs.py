"""Script: train the tiny transformer through the step API in several layouts, one after
another, and save (from rank 0) the full weights after setup and after training, gathered from
every stage and shard, with the per-step losses, gradient norms and validation loss.

Every mode trains on the same global batch: 16 sequences per optimizer step, as 2 accumulated
micro-batches per data-parallel rank.

Usage: pipeline_runs.py OUT MODE [MODE ...]
"""

from __future__ import annotations

import sys
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader

from dream_trainer.callbacks import Throughput
from dream_trainer.configs import DeviceParameters
from dream_trainer.mixins import EvalMixin
from dream_trainer.parallel.dtensor import local_tensor
from tests.helpers.launch import save_on_rank_zero
from tests.helpers.transformer import (VOCAB, StepAPITrainer, next_token_loss,
                                       transformer_config)

SCHEDULES = ["GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble",
             "ZBVZeroBubble", "DualPipeV"]
STEP_SAMPLES = 16
ACCUMULATION = 2
CLIP = 0.5  # below the gradient norms of these steps, so clipping scales every step

MODES: dict[str, tuple[DeviceParameters, int]] = {
    # name: (device parameters, data-parallel degree)
    "single": (DeviceParameters.SINGLE_DEVICE(), 1),
    **{schedule: (DeviceParameters(dp_replicate=1, pipeline_parallel=2,
                                   pipeline_schedule=schedule), 1) for schedule in SCHEDULES},
    "naive_scale_grads": (DeviceParameters(dp_replicate=1, pipeline_parallel=2), 1),
    "pp2_fsdp2": (DeviceParameters(dp_replicate=1, pipeline_parallel=2, dp_shard=2), 2),
    "pp2_tp2": (DeviceParameters(dp_replicate=1, pipeline_parallel=2, tensor_parallel=2), 1),
    "pp2_default_dp": (DeviceParameters(pipeline_parallel=2), 2),  # spare ranks shard
    "pp2_fsdp2_tp2": (DeviceParameters(dp_replicate=1, pipeline_parallel=2, dp_shard=2,
                                       tensor_parallel=2), 2),
    # HSDP inside each stage: 2 replicas of 2 shards.
    "pp2_hsdp": (DeviceParameters(dp_replicate=2, dp_shard=2, pipeline_parallel=2), 4),
    # The head's logits stay sharded on the vocabulary; the loss runs in loss_parallel().
    "tp2_loss_parallel": (DeviceParameters(dp_replicate=1, tensor_parallel=2,
                                           loss_parallel=True), 1),
    "pp2_tp2_loss_parallel": (DeviceParameters(dp_replicate=1, pipeline_parallel=2,
                                               tensor_parallel=2, loss_parallel=True), 1),
    # The user's own init_weights, drawing from the generator in every block.
    "single_drawn_init": (DeviceParameters.SINGLE_DEVICE(), 1),
    "1F1B_drawn_init": (DeviceParameters(dp_replicate=1, pipeline_parallel=2,
                                         pipeline_schedule="1F1B"), 1),
    # A user's stages at the step's points (Staged), in one process, FSDP2 and a pipeline.
    "staged_single": (DeviceParameters.SINGLE_DEVICE(), 1),
    "staged_fsdp2": (DeviceParameters(dp_replicate=1, dp_shard=2), 2),
    "staged_1F1B": (DeviceParameters(dp_replicate=1, pipeline_parallel=2,
                                     pipeline_schedule="1F1B"), 1),
}


def full(tensor: torch.Tensor) -> torch.Tensor:
    return (tensor.full_tensor() if isinstance(tensor, DTensor) else tensor).detach().clone()


def gathered(named: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The full tensors of every rank's parameters, merged by name (a collective)."""
    mine = {name: full(tensor) for name, tensor in named.items()}
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return mine
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    return {name: tensor for rank in everyone for name, tensor in rank.items()}


class AlternatingLength:
    """Collates every second micro-batch 2 tokens shorter. The shapes then change inside an
    accumulation window, so a pipeline builds its second schedule mid-window (torch clears
    FSDP gradients when a new schedule infers its shapes)."""

    def __init__(self) -> None:
        self.batches = 0

    def __call__(self, samples: list[tuple[torch.Tensor]]) -> list[torch.Tensor]:
        tokens = torch.stack([sample[0] for sample in samples])
        self.batches += 1
        return [tokens[:, :-2] if self.batches % 2 == 0 else tokens]


class Recording(StepAPITrainer, EvalMixin):
    """Keeps the weights after setup and after training, every step's values, and the
    validation accuracy, a metric updated where the logits are: inside the loss function."""

    def configure_metrics(self) -> None:
        from torchmetrics.classification import MulticlassAccuracy

        self.accuracy = MulticlassAccuracy(num_classes=VOCAB, average="micro")

    def validation_step(self, batch: Any, batch_idx: int) -> dict[str, Any]:
        (tokens,) = batch
        return {"val_loss": self.forward_loss(self.model, tokens[:, :-1], target=tokens[:, 1:],
                                              loss_fn=self.scored_loss)}

    def scored_loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        self.accuracy.update(logits.reshape(-1, VOCAB), targets.reshape(-1))
        return next_token_loss(logits, targets)

    def configure_dataloaders(self) -> tuple[DataLoader[Any], DataLoader[Any]]:
        train, val = super().configure_dataloaders()
        return DataLoader(train.dataset, batch_size=train.batch_size,
                          collate_fn=AlternatingLength()), val

    def post_setup(self) -> None:
        super().post_setup()
        self.initial = gathered(dict(self.unwrapped().named_parameters()))
        self.losses: list[float] = []
        self.grad_norms: list[float] = []
        self.val_losses: list[float] = []

    def unwrapped(self) -> torch.nn.Module:
        return getattr(self.model, "module", self.model)  # DDP without a pipeline

    def post_train_batch(self, result: dict[str, Any], batch_idx: int) -> None:
        self.losses.append(float(result["loss"]))
        if "grad_norm" in result:
            self.grad_norms.append(float(result["grad_norm"]))

    def post_val_epoch(self, result: dict[str, Any]) -> None:
        super().post_val_epoch(result)  # EvalMixin adds the metrics
        self.val_losses.append(result["val_loss"])
        self.val_accuracy = result["accuracy/MulticlassAccuracy"]

    def post_fit(self) -> None:
        self.final = gathered(dict(self.unwrapped().named_parameters()))
        # Only the last stage's ranks see logits: collect what every rank saw.
        everyone: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, getattr(self, "logit_placements", None))
        self.logit_placements = [seen for seen in everyone if seen is not None]


class VocabShardedHead(Recording):
    """Also splits the head over the vocabulary, leaving its logits sharded (a DTensor
    ``Shard(-1)``), and records the logits' placements the loss function receives."""

    def apply_tensor_parallel(self, tp_mesh: Any) -> None:
        from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

        super().apply_tensor_parallel(tp_mesh)
        if self.model.head is not None:
            parallelize_module(self.model.head, tp_mesh, ColwiseParallel(use_local_output=False))

    def training_step(self, batch: Any, batch_idx: int) -> dict[str, Any]:
        (tokens,) = batch
        loss = self.forward_backward(self.model, tokens[:, :-1], target=tokens[:, 1:],
                                     loss_fn=self.sharded_loss)
        if not self.is_accumulating_gradients:
            return {"loss": loss, "grad_norm": self.step(self.model, self.optimizer)}
        return {"loss": loss}

    def sharded_loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        self.logit_placements = [str(p) for p in getattr(logits, "placements", ())]
        return next_token_loss(logits, targets)

    def scored_loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        # The metric needs whole rows of logits; the loss does not.
        self.accuracy.update(full(logits).reshape(-1, VOCAB), targets.reshape(-1))
        return next_token_loss(logits, targets)


class DrawnInit(Recording):
    """nanoGPT's initialization: every linear weight drawn again from normal(0, 0.02), the
    embedding from normal(0, 1), in the model's module order."""

    def init_weights(self) -> None:
        with torch.no_grad():
            for module in self.model.modules():
                if isinstance(module, torch.nn.Linear):
                    torch.nn.init.normal_(module.weight, std=0.02)
                elif isinstance(module, torch.nn.Embedding):
                    module.weight.normal_()


class Staged(Recording):
    """A user's mixin at the step's points: after backward it adds 0.01 to every gradient
    (elementwise, so the same in every layout; the norm and clipping that follow see it), a
    voter that lets every update through, and after the update a record; every stage and
    hook appends its name to ``events``."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.events: list[str] = []
        self.step_points.add("after_backward", "noise", self.noise)
        self.update_vote.add("user", self.vote)
        self.step_points.add("after_update", "record", self.record)

    def pre_optimizer_step(self, model: Any, optimizer: Any) -> None:
        super().pre_optimizer_step(model, optimizer)
        self.events.append("pre_optimizer_step")

    def noise(self, model: torch.nn.Module, optimizer: Any) -> None:
        self.events.append("after_backward")
        self.before_update = [local_tensor(p).detach().clone() for p in model.parameters()]
        with torch.no_grad():
            for parameter in model.parameters():
                if parameter.grad is not None:
                    parameter.grad.add_(0.01)

    def vote(self, model: torch.nn.Module, optimizer: Any) -> bool:
        self.events.append("vote")
        return True

    def record(self, model: torch.nn.Module, optimizer: Any) -> None:
        # The update happened (the weights moved), and the gradients are not zeroed yet.
        after = [local_tensor(p).detach() for p in model.parameters()]
        assert any(not torch.equal(a, b) for a, b in zip(after, self.before_update))
        assert any(p.grad is not None for p in model.parameters())
        self.events.append("after_update")

    def post_optimizer_step(self, model: Any, optimizer: Any) -> None:
        super().post_optimizer_step(model, optimizer)
        self.events.append("post_optimizer_step")


class BackwardUnderPipeline(Recording):
    """Calls backward() as a plain training step would."""

    def training_step(self, batch: Any, batch_idx: int) -> dict[str, Any]:
        self.backward(torch.zeros((), requires_grad=True))
        return {}


def naive_scale_grads() -> None:
    """Make the pipeline do what torch's defaults do: ``scale_grads=True`` divides the
    gradients by the microbatch count at every schedule step, and the loss is scaled only for
    accumulation. That is right without accumulation and wrong with it (torchtitan#1732)."""
    import torch.distributed.pipelining.schedules as schedules

    from dream_trainer.mixins import setup
    from dream_trainer.parallel.pipeline_schedule import PipelineRunner

    original = schedules.get_schedule_class

    def default_scaling(name: str) -> type:
        class Default(original(name)):  # type: ignore[misc]
            def __init__(self, *args: Any, **kwargs: Any) -> None:
                super().__init__(*args, **{**kwargs, "scale_grads": True})
        return Default

    class Naive(PipelineRunner):
        def run(self, stages: Any, inputs: Any, target: Any, loss_fn: Any,
                loss_scale: float | None, sum_losses: bool) -> torch.Tensor:
            scale = None if loss_scale is None else loss_scale * self.microbatches
            return super().run(stages, inputs, target, loss_fn, scale, sum_losses)

    schedules.get_schedule_class = default_scaling  # type: ignore[assignment]
    setup.PipelineRunner = Naive  # type: ignore[misc]


def run(mode: str) -> dict[str, Any]:
    if mode == "backward_error":
        return backward_error()
    if mode == "ddp_error":
        return ddp_error()
    params, dp = MODES[mode]
    if mode == "naive_scale_grads":
        naive_scale_grads()
    config = transformer_config(params, STEP_SAMPLES // dp // ACCUMULATION, max_steps=3,
                                gradient_accumulation_steps=ACCUMULATION,
                                gradient_clip_val=CLIP)
    trainer_class = VocabShardedHead if params.loss_parallel else \
        DrawnInit if mode.endswith("_drawn_init") else \
        Staged if mode.startswith("staged_") else Recording
    trainer = trainer_class(config.model_copy(update={"n_layers": 4}))
    throughput = Throughput(window=1)
    trainer.callbacks.append(throughput)
    trainer.callbacks.attach(trainer)
    trainer.fit()
    val_losses = list(trainer.val_losses)
    # A pipeline validates after fit() too, in a process group of its own.
    after_fit = trainer.evaluate()["val_loss"] if mode == "1F1B" else None
    return {"after_fit_val_loss": after_fit, "val_losses": val_losses,
            "initial": trainer.initial, "final": trainer.final, "losses": trainer.losses,
            "grad_norms": trainer.grad_norms,
            "val_accuracy": trainer.val_accuracy, "global_step": trainer.global_step,
            "model_type": type(trainer.model).__name__,
            "training_step": type(trainer).training_step.__qualname__,
            "logit_placements": trainer.logit_placements,
            "throughput": throughput.latest if trainer.world.is_rank_zero else None,
            "events": getattr(trainer, "events", None)}


def ddp_error() -> dict[str, Any]:
    """dp_replicate='auto' next to a 2-stage pipeline on 4 ranks resolves to DDP replicas,
    refused as the degrees are resolved: when the trainer is built."""
    params = DeviceParameters(dp_replicate="auto", pipeline_parallel=2)
    try:
        Recording(transformer_config(params, 8)).fit()
    except ValueError as error:
        return {"error": str(error)}
    return {"error": None}


def backward_error() -> dict[str, Any]:
    params, _ = MODES["1F1B"]
    trainer = BackwardUnderPipeline(transformer_config(params, 8))
    try:
        trainer.fit()
    except RuntimeError as error:
        return {"error": str(error)}
    return {"error": None}


def main(out: str, modes: list[str]) -> None:
    save_on_rank_zero({mode: run(mode) for mode in modes}, out, "pipeline_runs")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
