"""Script: the rotary GPT trained under context parallelism, alone and with the other
degrees, several runs in one launch; rank 0 saves what each recorded to OUT.

Every run trains 3 optimizer steps of 2 accumulated micro-batches (a global batch of 4
sequences of 16 tokens) with SGD and binding gradient clipping, then validates. It records
the initial and final weights as full tensors by name (merged from every pipeline stage),
each step's loss and gradient norm, and the validation loss.

A run named ``ckpt_cp2`` trains 2 epochs under cp=2 with a checkpoint every 2 steps
(``resume="latest"``) in WORK/ckpt_cp2; ``ckpt_cp2_kill`` does the same in its own directory
and SIGKILLs rank 0 after step 5 (once per WORK): run again, it resumes from step 4.

A run named ``hf_<layout>`` fine-tunes instead the tiny Llama that WORK/pretrained holds
(``init_weights_from``) through ``forward_backward``, and exports it to WORK/export_<run>.
A run named ``window_<model>_<layout>`` fine-tunes a tiny transformers decoder with a
sliding window (``WINDOW_MODELS``) from its own seeded initialization the same way;
``window_padded_cp2`` calls one with a padding mask and records the error.

Usage: context_runs.py OUT WORK RUN [RUN ...]   (RUN names a layout of ``LAYOUTS``)
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader, TensorDataset

from dream_trainer.callbacks import Callback
from dream_trainer.configs import CheckpointParameters, DeviceParameters, TrainingParameters
from dream_trainer.mixins import CheckpointConfigMixin, CheckpointMixin
from dream_trainer.parallel.names import canonical_name
from tests.helpers.checkpointing import Killer
from tests.helpers.hf import SEQ, VOCAB, HFTrainer, hf_config
from tests.helpers.launch import save_on_rank_zero
from tests.helpers.rotary_gpt import GPTConfig, HandWrittenTrainer, RotaryGPTTrainer
from tests.scripts.layout_matrix import everyone

GLOBAL_BATCH, ACCUMULATION, CLIP = 4, 2, 0.3

LAYOUTS: dict[str, tuple[dict[str, Any], int]] = {
    # name: (device parameters, data-parallel degree)
    "one": ({}, 1),
    "cp2": ({"context_parallel": 2}, 1),
    "cp2_contiguous": ({"context_parallel": 2, "context_parallel_load_balance": False}, 1),
    "cp2_checkpointed": ({"context_parallel": 2, "checkpoint_activations": True}, 1),
    "cp2_fsdp2": ({"context_parallel": 2, "dp_shard": 2}, 2),
    "cp2_tp2": ({"context_parallel": 2, "tensor_parallel": 2}, 1),
    "cp2_pp2": ({"context_parallel": 2, "pipeline_parallel": 2, "dp_shard": 1}, 1),
    "cp2_hsdp": ({"context_parallel": 2, "dp_replicate": 2}, 2),
}


class Recorder(Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []
        self.grad_norms: list[float] = []
        self.validation: dict[str, float] = {}

    def post_train_batch(self, result: dict[str, Any], batch_idx: int) -> None:
        if "grad_norm" in result:
            self.losses.append(float(result["loss"]))
            self.grad_norms.append(float(result["grad_norm"]))

    def post_val_epoch(self, result: dict[str, Any]) -> None:
        self.validation = {key: float(value) for key, value in result.items()}

    def post_setup(self) -> None:
        self.initial = self.full_weights()

    def post_fit(self) -> None:
        self.weights = self.full_weights()

    def full_weights(self) -> dict[str, torch.Tensor]:
        """Every weight as a full tensor by name, from every pipeline stage (a collective)."""
        model = self.trainer.model
        weights = {canonical_name(model, key): full(param)
                   for key, param in model.named_parameters()}
        merged: dict[str, torch.Tensor] = {}
        for part in everyone(weights):
            merged.update(part)
        return merged


def full(tensor: torch.Tensor) -> torch.Tensor:
    return (tensor.full_tensor() if isinstance(tensor, DTensor) else tensor).detach().clone()


class HFContextTrainer(HFTrainer):
    """The tiny Llama on next-token targets shifted outside the model (the model's own
    ``labels`` shift would cross the parts of a split sequence), exported at the end."""

    export_dir: Path

    def configure_dataloaders(self) -> tuple[DataLoader[Any], None]:
        tokens = torch.randint(0, VOCAB, (32, SEQ + 1), generator=torch.Generator().manual_seed(2))
        return DataLoader(TensorDataset(tokens),
                          batch_size=self.config.training_parameters.train_batch_size), None

    def training_step(self, batch: Any, batch_idx: int) -> dict[str, Any]:
        (tokens,) = batch
        loss = self.forward_backward(self.model, tokens[:, :-1], target=tokens[:, 1:],
                                     loss_fn=hf_loss)
        return {"loss": loss, "grad_norm": self.step(self.model, self.optimizer)}

    def post_fit(self) -> None:
        super().post_fit()
        self.export_weights(self.export_dir)


def hf_loss(output: Any, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(output.logits.reshape(-1, VOCAB).float(), targets.reshape(-1))


WINDOW_MODELS = {
    # name: (architecture, sliding window); the sequence is 16 tokens, 8 per rank at cp=2
    "mistral12": ("mistral", 12),  # longer than a rank's part, shorter than the sequence
    "mistral6": ("mistral", 6),  # shorter than a rank's part
    "mistral3": ("mistral", 3),  # shorter than a balanced chunk (4)
    "qwen2": ("qwen2", 6),  # a full-attention layer, then a sliding one
}


def window_model(name: str) -> torch.nn.Module:
    from transformers import MistralConfig, MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM

    architecture, window = WINDOW_MODELS[name]
    sizes = {"vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 64,
             "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
             "max_position_embeddings": 2 * SEQ}
    if architecture == "mistral":
        return MistralForCausalLM(MistralConfig(sliding_window=window, **sizes))
    config = Qwen2Config(use_sliding_window=True, sliding_window=window, max_window_layers=1,
                         **sizes)
    assert config.layer_types == ["full_attention", "sliding_attention"]
    return Qwen2ForCausalLM(config)


class WindowTrainer(HFContextTrainer):
    """A sliding-window decoder fine-tuned as ``HFContextTrainer`` fine-tunes the Llama
    (no export); with ``padded``, its first step passes a mask that pads the first sequence's
    last position (held by one rank only)."""

    window_model: str
    padded = False

    def configure_models(self) -> None:
        self.model = window_model(self.window_model)

    def training_step(self, batch: Any, batch_idx: int) -> dict[str, Any]:
        if self.padded:
            (tokens,) = batch
            mask = torch.ones_like(tokens[:, :-1])
            mask[0, -1] = 0
            self.forward_backward(self.model, tokens[:, :-1], mask, target=tokens[:, 1:],
                                  loss_fn=hf_loss)
        return super().training_step(batch, batch_idx)

    def post_fit(self) -> None:
        pass


def device_parameters(name: str) -> DeviceParameters:
    layout, _ = LAYOUTS[name]
    return DeviceParameters(device="cpu", **({"dp_replicate": 1} | layout)) if layout \
        else DeviceParameters.SINGLE_DEVICE()


class CheckpointedConfig(GPTConfig, CheckpointConfigMixin):
    pass


class CheckpointedTrainer(RotaryGPTTrainer, CheckpointMixin):
    config: CheckpointedConfig


def checkpointed_run(name: str, work: Path) -> dict[str, Any]:
    base = config("cp2")
    checkpointed = CheckpointedConfig(**{
        **dict(base), "experiment": name,
        "training_parameters": base.training_parameters.model_copy(update={"n_epochs": 2})},
        checkpoint_parameters=CheckpointParameters(root_dir=work / name, every_n_steps=2,
                                                   resume="latest"))
    trainer = CheckpointedTrainer(checkpointed)
    recorder = Recorder()
    trainer.callbacks.append(recorder)
    if name.endswith("_kill"):
        (work / "markers").mkdir(exist_ok=True)
        trainer.callbacks.append(Killer(["step:5"], work / "markers"))
    trainer.callbacks.attach(trainer)
    trainer.fit()
    return {"weights": recorder.weights, "global_step": trainer.global_step}


def hf_run(name: str, work: Path) -> dict[str, Any]:
    config = hf_config(device_parameters=device_parameters(name.removeprefix("hf_")),
                       init_weights_from=work / "pretrained")
    trainer = HFContextTrainer(config.model_copy(update={"experiment": name}))
    trainer.export_dir = work / f"export_{name}"
    recorder = Recorder()
    trainer.callbacks.append(recorder)
    trainer.callbacks.attach(trainer)
    trainer.fit()
    return {"initial": recorder.initial, "weights": recorder.weights,
            "losses": recorder.losses, "export": str(trainer.export_dir)}


def window_run(name: str, work: Path) -> dict[str, Any]:
    _, model, layout = name.split("_")
    config = hf_config(device_parameters=device_parameters(layout), seed=3)
    trainer = WindowTrainer(config.model_copy(update={"experiment": name}))
    trainer.window_model, trainer.padded = model if model != "padded" else "mistral6", \
        model == "padded"
    if trainer.padded:
        try:
            trainer.fit()
        except ValueError as error:
            return {"error": str(error)}
        return {"error": None}
    recorder = Recorder()
    trainer.callbacks.append(recorder)
    trainer.callbacks.attach(trainer)
    trainer.fit()
    return {"initial": recorder.initial, "weights": recorder.weights,
            "losses": recorder.losses}


def config(name: str, summed: bool = True) -> GPTConfig:
    _, dp = LAYOUTS[name.removesuffix("_mean")]
    device = device_parameters(name.removesuffix("_mean"))
    return GPTConfig(
        project="context", group="tests", experiment=name, seed=7, summed=summed,
        n_sequences=3 * GLOBAL_BATCH * ACCUMULATION, device_parameters=device,
        training_parameters=TrainingParameters(
            n_epochs=1, train_batch_size=GLOBAL_BATCH // dp,
            gradient_accumulation_steps=ACCUMULATION, gradient_clip_val=CLIP))


def run(name: str) -> dict[str, Any]:
    """One run; a name ending in ``_mean`` trains on the mean loss without ``num_items``,
    one ending in ``_hand`` through a hand-written step in ``context_parallel``,
    ``cp2_odd_length`` on sequences of 14 tokens (4 chunks do not divide them) and
    records the error."""
    if name == "cp2_odd_length":
        odd = config("cp2").model_copy(update={"seq_len": 14})
        try:
            RotaryGPTTrainer(odd).fit()
        except ValueError as error:
            return {"error": str(error)}
        return {"error": None}
    kind = HandWrittenTrainer if name.endswith("_hand") else RotaryGPTTrainer
    trainer = kind(config(name.removesuffix("_hand"), summed=not name.endswith("_mean")))
    recorder = Recorder()
    trainer.callbacks.append(recorder)
    trainer.callbacks.attach(trainer)
    trainer.fit()
    return {"initial": recorder.initial, "weights": recorder.weights,
            "losses": recorder.losses, "grad_norms": recorder.grad_norms,
            "validation": recorder.validation}


def main(out: str, work: str, names: list[str]) -> None:
    runs = {"hf": hf_run, "ckpt": checkpointed_run, "window": window_run}
    results = {name: runs[name.split("_")[0]](name, Path(work)) if name.split("_")[0] in runs
               else run(name) for name in names}
    save_on_rank_zero(results, out, "context_runs")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3:])
