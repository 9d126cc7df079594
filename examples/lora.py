"""LoRA fine-tuning of a Hugging Face causal LM with peft, on 2 FSDP2 ranks, and its adapter export.

    pip install -e ".[hf,lora]"   # transformers and peft: this example's only extras
    torchrun --standalone --nproc_per_node=2 examples/lora.py
    torchrun --standalone --nproc_per_node=2 examples/lora.py --base_dtype bfloat16
    torchrun --standalone --nproc_per_node=2 examples/lora.py --lora.r 16 \\
        --lora.target_modules '["q_proj", "v_proj"]'
    python examples/lora.py --init_weights_from path/to/a/save_pretrained/directory

Nothing is downloaded. Unless ``--init_weights_from`` names a directory, the first run creates
a small Llama (``config.json`` and random weights, written by ``save_pretrained``) in
``outputs/examples/lora/pretrained``: the stand-in for a base model from the Hub. The text is
the Python standard library's source on disk, one token per byte (vocabulary of 256, no
tokenizer), as in ``char_gpt.py``.

What it shows:

- ``configure_models`` builds ``LlamaForCausalLM`` from the base directory's config on the
  meta device and wraps it with ``peft.get_peft_model``: dream_trainer shards it with FSDP2,
  reads the base's weights into each rank's shards (``init_weights_from``) and initializes
  the adapters as peft does (A drawn, B at zero), so training starts from the base itself.
- The base directory loads into the wrapped model as into the bare one: dream_trainer finds
  each file key under peft's names (``base_model.model...``, ``...q_proj.base_layer.weight``),
  and the adapters, which a base's files lack, keep peft's initialization.
- Only the adapters require gradients, and only they go to the optimizer. With
  ``--base_dtype bfloat16`` the base is cast before wrapping and the adapters stay float32
  (``param_dtype`` stays float32, so FSDP2 casts neither: see docs/finetuning.md, "LoRA").
- Checkpoints (``outputs/examples/lora/llama/checkpoints``) hold what trains: the adapters,
  their AdamW state and the run state. The frozen base is left out and its source recorded
  (``CheckpointParameters.save_frozen_weights``, False by default), so a resume
  (``--checkpoint_parameters.resume latest``) reads it from ``init_weights_from`` again.
- At the end ``export_weights(..., format="peft")`` writes ``adapter_model.safetensors`` and
  ``adapter_config.json`` to ``outputs/examples/lora/adapter``; rank 0 loads them onto the
  base with ``PeftModel.from_pretrained`` and prints how far its logits are from the trained
  model's: 0 up to rounding (float32's, or bfloat16's with a bfloat16 base), since the base
  was frozen and the adapter is all that changed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import torch
import torch.nn.functional as F
from pydantic import Field, PositiveFloat, PositiveInt
from torch.utils.data import DataLoader
from typing_extensions import override

# Run as a script, this file's directory is sys.path[0], so its sibling imports as a module.
from char_gpt import VOCAB_SIZE, ByteWindows, stdlib_text
from finetune_hf import LlamaShape, ensure_pretrained

from dream_trainer import DreamTrainer, DreamTrainerConfig
from dream_trainer.callbacks import CallbackCollection
from dream_trainer.configs import (CheckpointParameters, ConfigModel, DeviceParameters,
                                   LoggingParameters, TrainingParameters, apply_cli_overrides)

OUTPUTS = Path("outputs/examples/lora")
PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


class LoraShape(ConfigModel):
    """The adapters: peft's ``LoraConfig`` fields that this example sets."""

    r: PositiveInt = 8
    lora_alpha: PositiveFloat = 16
    lora_dropout: float = Field(default=0.0, ge=0, lt=1)
    target_modules: list[str] = Field(default_factory=lambda: list(PROJECTIONS))
    """Module names (their last component) that get an adapter."""


class LoraExampleConfig(DreamTrainerConfig):
    llama: LlamaShape = Field(default_factory=LlamaShape)
    """Shape of the stand-in base model."""
    lora: LoraShape = Field(default_factory=LoraShape)
    base_dtype: Literal["float32", "bfloat16"] = "float32"
    """Dtype of the frozen base; the adapters are float32 either way."""
    files: str = "json/*.py"
    """Glob, relative to the standard library directory, of the text to fine-tune on."""
    val_fraction: float = Field(default=0.1, gt=0, lt=1)
    """Share of the text, from its end, used for validation."""
    learning_rate: float = Field(default=1e-2, gt=0)
    """AdamW learning rate of the adapters (LoRA takes a larger one than full fine-tuning)."""
    export_dir: Path = OUTPUTS / "adapter"
    """Where the trained adapter is written in peft's layout."""


class LoraTrainer(DreamTrainer):
    config: LoraExampleConfig

    def __init__(self, config: LoraExampleConfig) -> None:
        super().__init__(config)
        self.val_losses: list[tuple[int, float]] = []

    @override
    def configure_models(self) -> None:
        from peft import LoraConfig, get_peft_model
        from transformers import AutoConfig, LlamaForCausalLM

        # Runs on the meta device: no memory, no initialization until the model is sharded.
        base = LlamaForCausalLM(AutoConfig.from_pretrained(self.config.init_weights_from))
        lora = self.config.lora
        # peft freezes the base and keeps its adapters in float32 on a bfloat16 base.
        self.model = get_peft_model(
            base.to(getattr(torch, self.config.base_dtype)),
            LoraConfig(r=lora.r, lora_alpha=lora.lora_alpha, lora_dropout=lora.lora_dropout,
                       target_modules=lora.target_modules))

    @override
    def configure_optimizers(self) -> None:
        trainable = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(trainable, lr=self.config.learning_rate)

    @override
    def configure_dataloaders(self) -> tuple[DataLoader[Any], DataLoader[Any]]:
        text = stdlib_text(self.config.files)
        split = int(len(text) * (1 - self.config.val_fraction))
        context = self.config.llama.context
        params = self.config.training_parameters
        return (DataLoader(ByteWindows(text[:split], context), shuffle=True, drop_last=True,
                           batch_size=params.train_batch_size),
                DataLoader(ByteWindows(text[split:], context),
                           batch_size=params.val_batch_size))

    def next_byte_loss(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = self.model(input_ids=inputs).logits
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())

    @override
    def training_step(self, batch: Any, batch_idx: int) -> dict[str, Any]:
        loss = self.next_byte_loss(*batch)
        self.backward(loss)
        if self.is_accumulating_gradients:
            return {"loss": loss}
        return {"loss": loss, "grad_norm": self.step(self.model, self.optimizer)}

    @override
    def validation_step(self, batch: Any, batch_idx: int) -> dict[str, Any]:
        return {"val_loss": self.next_byte_loss(*batch)}

    @override
    def pre_fit(self) -> None:
        super().pre_fit()
        if self.world.is_rank_zero:
            print(f"started from {Path(self.config.init_weights_from).resolve()}", flush=True)
            # Counted on the unsharded model's parameters, not this rank's shards.
            counts = {trains: sum(p.numel() for p in self.model.parameters()
                                  if p.requires_grad == trains) for trains in (True, False)}
            print(f"trainable parameters: {counts[True]} of {counts[True] + counts[False]}",
                  flush=True)
        self.evaluate(max_batches=self.config.training_parameters.val_steps_per_epoch)

    @override
    def post_val_epoch(self, result: dict[str, Any]) -> None:
        super().post_val_epoch(result)
        if not self.sanity_checking:
            self.val_losses.append((self.global_step, float(result["val_loss"])))
            if self.world.is_rank_zero:
                print(f"step {self.global_step}: val_loss={self.val_losses[-1][1]:.4f}",
                      flush=True)

    @override
    def post_fit(self) -> None:
        super().post_fit()
        # Collective: every rank gathers its adapter shards, rank 0 writes them. A rerun
        # replaces the export of the previous one.
        self.export_weights(self.config.export_dir, format="peft", overwrite=True)
        # Collective (FSDP2 gathers the weights): the trained model's logits on fixed bytes.
        tokens = torch.arange(2 * 32, device=self.world.device).view(2, 32) * 7 % VOCAB_SIZE
        self.model.eval()
        with torch.no_grad():
            trained = self.model(input_ids=tokens).logits.float().cpu()
        if self.world.is_rank_zero:
            reloaded = reload_adapter(Path(self.config.init_weights_from),
                                      self.config.export_dir, tokens.cpu(),
                                      getattr(torch, self.config.base_dtype))
            print(f"exported: {self.config.export_dir.resolve()} (PeftModel.from_pretrained's "
                  f"logits differ by {(reloaded - trained).abs().max():.2e})")


def reload_adapter(base_dir: Path, adapter_dir: Path, tokens: torch.Tensor,
                   dtype: torch.dtype) -> torch.Tensor:
    """The logits on ``tokens`` of the base in ``base_dir`` (loaded in ``dtype``) with the
    adapter of ``adapter_dir``, both loaded as a peft user would."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=dtype)
    model = PeftModel.from_pretrained(base, adapter_dir).eval()
    with torch.no_grad():
        return model(input_ids=tokens).logits.float()


def default_config() -> LoraExampleConfig:
    """The run ``torchrun --standalone --nproc_per_node=2 examples/lora.py`` trains."""
    return LoraExampleConfig(
        project="examples", group="lora", experiment="llama",
        init_weights_from=OUTPUTS / "pretrained",
        device_parameters=DeviceParameters.FSDP(),
        training_parameters=TrainingParameters(
            n_epochs=2, train_steps_per_epoch=30, train_batch_size=8, val_batch_size=16,
            val_steps_per_epoch=4, gradient_clip_val=1.0),
        checkpoint_parameters=CheckpointParameters(root_dir=Path("outputs"), keep_top_k=1),
        logging_parameters=LoggingParameters(log_dir=Path("outputs"), log_every_n_steps=10),
        callbacks=CallbackCollection([]),
    )


def make_trainer(args: list[str] | None = None) -> LoraTrainer:
    """The example's trainer, with ``args`` (default: the command line) as config overrides;
    creates the stand-in base when ``init_weights_from`` is the default."""
    config = apply_cli_overrides(default_config(), args, description=__doc__)
    if config.init_weights_from == default_config().init_weights_from:
        ensure_pretrained(OUTPUTS / "pretrained", config.llama)
    return LoraTrainer(config)


def main() -> None:
    trainer = make_trainer()
    trainer.fit()
    if trainer.world.is_rank_zero:
        (_, before), (step, after) = trainer.val_losses[0], trainer.val_losses[-1]
        print(f"val_loss before fine-tuning={before:.4f}, after {step} steps={after:.4f}")
        print(f"checkpoints: {trainer.checkpoint_dir.resolve()}")


if __name__ == "__main__":
    main()
