"""Fine-tune a Hugging Face causal LM from its pretrained weights, and export it back.

    pip install -e ".[hf]"        # transformers: this example's only extra dependency
    torchrun --standalone --nproc_per_node=2 examples/finetune_hf.py
    torchrun --standalone --nproc_per_node=4 examples/finetune_hf.py \\
        --device_parameters.tensor_parallel 2
    torchrun --standalone --nproc_per_node=2 examples/finetune_hf.py \\
        --device_parameters.pipeline_parallel 2
    torchrun --standalone --nproc_per_node=2 examples/finetune_hf.py \\
        --device_parameters.pipeline_parallel 2 --llama.tie_word_embeddings true
    python examples/finetune_hf.py --init_weights_from path/to/a/save_pretrained/directory

Nothing is downloaded. Unless ``--init_weights_from`` names a directory, the first run creates
a small Llama (its ``config.json`` and random weights, written by ``save_pretrained``) in
``outputs/examples/finetune_hf/pretrained``: the stand-in for a model from the Hub, which
any later run starts from. The text is the Python standard library's source on disk, one
token per byte, so the model's vocabulary is the 256 byte values and no tokenizer is needed.

What it shows:

- ``configure_models`` builds ``LlamaForCausalLM`` from the pretrained directory's config
  on the meta device, and there is no ``init_weights``: dream_trainer initializes the model
  as transformers does (its RMSNorm weights, its rotary ``inv_freq`` buffers), then
  ``init_weights_from`` reads the pretrained weights into each rank's FSDP2 shards.
- ``apply_tensor_parallel`` is a tensor-parallel plan for transformers' Llama blocks, used
  when ``tensor_parallel > 1``.
- ``training_step`` and ``validation_step`` go through ``forward_backward`` and
  ``forward_loss``, so the same code trains under ``pipeline_parallel > 1``: dream_trainer
  splits transformers' decoders into stages itself (embedding first, layers evenly, norm and
  head last), and each rank reads only its stages' pretrained weights. With
  ``--llama.tie_word_embeddings true`` the stand-in ties its output layer to its embedding
  (in ``outputs/examples/finetune_hf/pretrained_tied``): the first and last stages each hold
  the weight, their gradients are summed before every step, and the export ties them again.
- At the end ``export_weights`` writes the fine-tuned weights in the Hugging Face layout
  (``model.safetensors`` and ``config.json``) to ``outputs/examples/finetune_hf/exported``;
  rank 0 loads them with ``AutoModelForCausalLM.from_pretrained`` and prints how far its
  loss on a fixed batch is from the trained model's (0 up to float rounding).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from pydantic import Field, PositiveInt
from torch.distributed.device_mesh import DeviceMesh
from torch.utils.data import DataLoader
from typing_extensions import override

# Run as a script, this file's directory is sys.path[0], so its sibling imports as a module.
from char_gpt import VOCAB_SIZE, ByteWindows, stdlib_text

from dream_trainer import DreamTrainer, DreamTrainerConfig
from dream_trainer.callbacks import CallbackCollection
from dream_trainer.configs import (CheckpointParameters, ConfigModel, DeviceParameters,
                                   LoggingParameters, TrainingParameters, apply_cli_overrides)

OUTPUTS = Path("outputs/examples/finetune_hf")


class LlamaShape(ConfigModel):
    """The shape of the stand-in pretrained model (used only when it is created)."""

    hidden_size: PositiveInt = 128
    intermediate_size: PositiveInt = 344
    num_hidden_layers: PositiveInt = 4
    num_attention_heads: PositiveInt = 4
    num_key_value_heads: PositiveInt = 2
    context: PositiveInt = 128
    """Bytes per training window, and the model's maximum position."""
    tie_word_embeddings: bool = False
    """Share one weight between the embedding and the output layer, as Llama-3.2-1B does;
    under a pipeline the first and last stages each hold a copy, kept equal."""

    def stand_in_dir(self) -> Path:
        """Where the stand-in model of this shape's kind is created."""
        return OUTPUTS / ("pretrained_tied" if self.tie_word_embeddings else "pretrained")


class FinetuneConfig(DreamTrainerConfig):
    llama: LlamaShape = Field(default_factory=LlamaShape)
    """Shape of the stand-in pretrained model."""
    files: str = "json/*.py"
    """Glob, relative to the standard library directory, of the text to fine-tune on."""
    val_fraction: float = Field(default=0.1, gt=0, lt=1)
    """Share of the text, from its end, used for validation."""
    learning_rate: float = Field(default=3e-3, gt=0)
    """AdamW learning rate."""
    export_dir: Path = OUTPUTS / "exported"
    """Where the fine-tuned weights are written in the Hugging Face layout."""


class FinetuneTrainer(DreamTrainer):
    config: FinetuneConfig

    def __init__(self, config: FinetuneConfig) -> None:
        super().__init__(config)
        self.val_losses: list[tuple[int, float]] = []

    @override
    def configure_models(self) -> None:
        from transformers import AutoConfig, LlamaForCausalLM

        # Runs on the meta device: no memory, no initialization until the model is sharded.
        config = AutoConfig.from_pretrained(self.config.init_weights_from)
        self.model = LlamaForCausalLM(config)

    @override
    def apply_tensor_parallel(self, tp_mesh: DeviceMesh) -> None:
        from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                       parallelize_module)

        # transformers' Llama attention takes its head count from the projections' width,
        # so column-parallel q/k/v give each rank whole heads and o_proj adds them up.
        plan = {"self_attn.q_proj": ColwiseParallel(), "self_attn.k_proj": ColwiseParallel(),
                "self_attn.v_proj": ColwiseParallel(), "self_attn.o_proj": RowwiseParallel(),
                "mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel(),
                "mlp.down_proj": RowwiseParallel()}
        for layer in self.model.model.layers:
            if layer is not None:  # under a pipeline, other stages' layers are None
                parallelize_module(layer, tp_mesh, plan)

    @override
    def configure_optimizers(self) -> None:
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=self.config.learning_rate)

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

    @staticmethod
    def next_byte_loss(output: Any, targets: torch.Tensor) -> torch.Tensor:
        # One process gets the model's output object, a pipeline's last stage the logits.
        logits = getattr(output, "logits", output)
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())

    @override
    def training_step(self, batch: Any, batch_idx: int) -> dict[str, Any]:
        inputs, targets = batch
        # model(inputs), the loss and backward; under a pipeline, the schedule does them.
        loss = self.forward_backward(self.model, inputs, target=targets,
                                     loss_fn=self.next_byte_loss)
        if self.is_accumulating_gradients:
            return {"loss": loss}
        return {"loss": loss, "grad_norm": self.step(self.model, self.optimizer)}

    @override
    def validation_step(self, batch: Any, batch_idx: int) -> dict[str, Any]:
        inputs, targets = batch
        return {"val_loss": self.forward_loss(self.model, inputs, target=targets,
                                              loss_fn=self.next_byte_loss)}

    @override
    def pre_fit(self) -> None:
        super().pre_fit()
        if self.world.is_rank_zero:
            print(f"started from {Path(self.config.init_weights_from).resolve()}", flush=True)
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
        # Collective: every rank writes its slices, rank 0 consolidates them. A rerun of the
        # example replaces the export of the previous one (the directory holds nothing else).
        self.export_weights(self.config.export_dir, overwrite=True)
        # Collective (FSDP2, a pipeline): every rank computes the trained model's loss.
        tokens = torch.arange(4 * 33, device=self.world.device).view(4, 33) % VOCAB_SIZE
        inputs, targets = tokens[:, :-1], tokens[:, 1:]
        self.model.eval()
        with torch.no_grad():
            trained = float(self.forward_loss(self.model, inputs, target=targets,
                                              loss_fn=self.next_byte_loss))
        if self.world.is_rank_zero:
            from transformers import AutoModelForCausalLM

            exported = AutoModelForCausalLM.from_pretrained(self.config.export_dir)
            with torch.no_grad():
                reloaded = float(self.next_byte_loss(exported(input_ids=inputs.cpu()),
                                                     targets.cpu()))
            print(f"exported: {self.config.export_dir.resolve()} (from_pretrained's loss "
                  f"differs by {abs(reloaded - trained):.2e})")


def ensure_pretrained(path: Path, shape: LlamaShape) -> None:
    """Create the stand-in pretrained model at ``path`` unless a model is there already.

    Under torchrun every rank may get here first: each writes a complete copy (the same
    seed gives the same weights) to a directory of its own and renames it into place; the
    first rename wins and the others are discarded.
    """
    if (path / "config.json").is_file():
        return
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=VOCAB_SIZE, hidden_size=shape.hidden_size,
                         intermediate_size=shape.intermediate_size,
                         num_hidden_layers=shape.num_hidden_layers,
                         num_attention_heads=shape.num_attention_heads,
                         num_key_value_heads=shape.num_key_value_heads,
                         max_position_embeddings=shape.context,
                         tie_word_embeddings=shape.tie_word_embeddings)
    torch.manual_seed(0)
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}."))
    LlamaForCausalLM(config).save_pretrained(staging)
    try:
        os.rename(staging, path)
    except OSError:  # another rank's copy is already in place
        shutil.rmtree(staging)


def default_config() -> FinetuneConfig:
    """The run ``torchrun --standalone --nproc_per_node=2 examples/finetune_hf.py`` trains."""
    return FinetuneConfig(
        project="examples", group="finetune_hf", experiment="llama",
        init_weights_from=OUTPUTS / "pretrained",
        device_parameters=DeviceParameters.FSDP(),
        training_parameters=TrainingParameters(
            n_epochs=2, train_steps_per_epoch=30, train_batch_size=8, val_batch_size=16,
            val_steps_per_epoch=4, gradient_clip_val=1.0),
        checkpoint_parameters=CheckpointParameters(root_dir=Path("outputs"), keep_top_k=1),
        logging_parameters=LoggingParameters(log_dir=Path("outputs"), log_every_n_steps=10),
        callbacks=CallbackCollection([]),
    )


def make_trainer(args: list[str] | None = None) -> FinetuneTrainer:
    """The example's trainer, with ``args`` (default: the command line) as config overrides;
    creates the stand-in pretrained model when ``init_weights_from`` is the default (a tied
    one, in a directory of its own, with ``--llama.tie_word_embeddings true``)."""
    config = apply_cli_overrides(default_config(), args, description=__doc__)
    if config.init_weights_from == default_config().init_weights_from:
        stand_in = config.llama.stand_in_dir()
        ensure_pretrained(stand_in, config.llama)
        config = config.model_copy(update={"init_weights_from": stand_in})
    return FinetuneTrainer(config)


def main() -> None:
    trainer = make_trainer()
    trainer.fit()
    if trainer.world.is_rank_zero:
        (_, before), (step, after) = trainer.val_losses[0], trainer.val_losses[-1]
        print(f"val_loss before fine-tuning={before:.4f}, after {step} steps={after:.4f}")
        print(f"checkpoints: {trainer.checkpoint_dir.resolve()}")


if __name__ == "__main__":
    main()
