"""Script: a LoRA fine-tune (peft, r=4 on the attention and MLP projections) of a tiny
transformers Llama built on the meta device, one run per layout in one launch; rank 0 saves
each run's initial and final weights (every rank's, gathered) and the batches it trained on.
A ``_tied`` layout fine-tunes the Llama whose head is tied to its embedding, with adapters on
the attention projections only.

    torchrun --nproc_per_node=N lora_run.py OUT EXPORT_ROOT LAYOUT [LAYOUT ...]

Each run exports its adapter (``format="peft"``) to EXPORT_ROOT/<layout> at the end.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch

from dream_trainer.configs import DeviceParameters, TrainingParameters
from dream_trainer.parallel.names import clean_name
from tests.helpers.hf import (RecordingHFTrainer, hf_config, llama_tensor_parallel_plan,
                              summed_loss)
from tests.helpers.launch import save_on_rank_zero

LAYOUTS = {"single": DeviceParameters.SINGLE_DEVICE(), "ddp": DeviceParameters.DDP(),
           "fsdp": DeviceParameters.FSDP(), "hsdp": DeviceParameters.HSDP(dp_shard=2),
           "tp": DeviceParameters(tensor_parallel=2, dp_shard=1),
           "cp": DeviceParameters(context_parallel=2, dp_shard=1),
           "pp": DeviceParameters(pipeline_parallel=2, dp_shard=1)}
DATA_PARALLEL = {"ddp": 2, "fsdp": 2, "hsdp": 4}
"""Data-parallel ranks of each layout; a ``_bf16`` suffix keeps the base in bfloat16 (the
adapters in float32), a ``_tied`` suffix trains the tied Llama."""
GLOBAL_BATCH, STEPS = 4, 3
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
ATTENTION = TARGETS[:4]


def lora_config(targets: list[str] = TARGETS) -> Any:
    from peft import LoraConfig

    return LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=targets)


IGNORE = -100  # the targets the loss ignores


class LoraTrainer(RecordingHFTrainer):
    base_dtype = torch.float32
    export_dir: Path | None = None

    def configure_models(self) -> None:
        from peft import get_peft_model

        super().configure_models()
        # peft keeps the adapters in float32 on a bfloat16 base (autocast_adapter_dtype).
        targets = ATTENTION if self.config.architecture == "llama_tied" else TARGETS
        self.model = get_peft_model(self.model.to(self.base_dtype), lora_config(targets))

    def apply_tensor_parallel(self, tp_mesh: Any) -> None:
        from torch.distributed.tensor.parallel import parallelize_module

        from dream_trainer.parallel.lora import lora_tensor_parallel_plan

        # The base's plan, the adapters placed to follow it.
        for layer in self.model.base_model.model.model.layers:
            parallelize_module(layer, tp_mesh,
                               lora_tensor_parallel_plan(layer, llama_tensor_parallel_plan()))

    def training_step(self, batch: Any, batch_idx: int) -> dict[str, Any]:
        # The next-token loss summed outside the model, over the tokens that have a next
        # one, so that context parallelism can split the sequence (transformers' own loss
        # shifts inside it): the mean over them is transformers' loss with labels=tokens.
        (tokens,) = batch
        targets = torch.cat([tokens[:, 1:], torch.full_like(tokens[:, :1], IGNORE)], 1)
        loss = self.forward_backward(self.model, tokens, target=targets, loss_fn=summed_loss,
                                     num_items=int((targets != IGNORE).sum()))
        self.step(self.model, self.optimizer)
        return {"loss": loss}

    def configure_optimizers(self) -> None:
        self.optimizer = torch.optim.SGD(
            [p for p in self.model.parameters() if p.requires_grad], lr=self.config.lr)

    def post_fit(self) -> None:
        super().post_fit()
        # Every rank's names (a pipeline rank holds its stages' only): what trains, and the
        # frozen parameters that were given a gradient anyway (none should be).
        held = gathered_names(self.model)
        self.trainable = sorted({name for names, _ in held for name in names})
        self.frozen_with_gradients = sorted({name for _, names in held for name in names})
        if self.export_dir is not None:
            self.export_weights(self.export_dir, format="peft")


def gathered_names(model: torch.nn.Module) -> list[tuple[list[str], list[str]]]:
    """Every rank's names of its trainable parameters, and of its frozen ones holding a
    gradient."""
    import torch.distributed as dist

    mine: tuple[list[str], list[str]] = ([], [])
    for name, param in getattr(model, "module", model).named_parameters():
        if param.requires_grad or param.grad is not None:
            mine[0 if param.requires_grad else 1].append(clean_name(name))
    if not dist.is_initialized():
        return [mine]
    pieces: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(pieces, mine)
    return pieces


def run(layout: str, export_root: str | None = None) -> dict[str, Any]:
    name, _, variant = layout.partition("_")
    ranks = DATA_PARALLEL.get(name, 1)
    config = hf_config("llama_tied" if variant == "tied" else "llama",
                       device_parameters=LAYOUTS[name], training_parameters=TrainingParameters(
                           n_epochs=1, max_steps=STEPS, train_batch_size=GLOBAL_BATCH // ranks))
    kind = type("Bf16LoraTrainer", (LoraTrainer,), {"base_dtype": torch.bfloat16}) \
        if variant == "bf16" else LoraTrainer
    trainer = kind(config)
    if export_root is not None:
        trainer.export_dir = Path(export_root) / layout
    trainer.fit()
    return {"initial": trainer.initial, "final": trainer.final, "trainable": trainer.trainable,
            "frozen_with_gradients": trainer.frozen_with_gradients,
            "steps": trainer.global_step, "lr": config.lr}


def main(out: str, export_root: str, layouts: list[str]) -> None:
    save_on_rank_zero({layout: run(layout, export_root) for layout in layouts}, out, "lora")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3:])
