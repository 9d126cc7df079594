"""A character-level GPT trained with FSDP2 on the Python standard library's own source.

    torchrun --standalone --nproc_per_node=2 examples/char_gpt.py
    torchrun --standalone --nproc_per_node=2 examples/char_gpt.py \\
        --checkpoint_parameters.resume latest --training_parameters.n_epochs 8
    torchrun --standalone --nproc_per_node=2 examples/char_gpt.py \\
        --device_parameters.pipeline_parallel 2
    python examples/char_gpt.py --help

The text is always on disk: the standard library modules matching ``files`` (a glob relative
to the directory of ``os.py``, sorted), concatenated. Tokens are bytes, so the vocabulary is
0..255 and no tokenizer is needed; the last ``val_fraction`` of the text is the validation set.

What it shows:

- ``DreamTrainer``: the model is built on the meta device, sharded with FSDP2 over every rank
  (``DeviceParameters.FSDP()``: each block of the ``nn.ModuleList`` and then the root), and
  only then materialized and initialized, shard by shard.
- An "epoch" here is ``train_steps_per_epoch`` optimizer steps on a fresh random subset of the
  text windows; each ends with a validation pass and a checkpoint. Rank 0 prints
  ``step <N>: val_loss=<float>`` after every pass, including one before the first step, so
  a fresh model starts near ln(256) = 5.55 and the loss should be clearly lower within a
  minute or two on two CPU ranks.
- Resume: the checkpoints go to ``<root_dir>/examples/char_gpt/gpt/checkpoints/step_<N>``.
  Run the same command again with ``--checkpoint_parameters.resume latest`` (after a crash,
  Ctrl-C, or with more epochs as above) and training continues from the newest complete
  checkpoint: the first line printed is that step's validation loss again.
- Every config field can be overridden from the command line (``apply_cli_overrides``),
  nested ones with dots: ``--gpt.n_layers 2 --training_parameters.train_batch_size 8``.
- Pipeline parallelism: ``--device_parameters.pipeline_parallel 2`` splits the blocks into
  two stages, one per rank (``--device_parameters.pipeline_schedule`` picks the schedule).
  The same ``training_step`` runs either way, because it calls ``forward_backward`` rather
  than the model; ``CharGPT.forward`` skips the modules that are None, which is all the
  default split needs. Checkpoints keep their keys, so a pipeline run resumes without one
  and the reverse. No sample is generated under a pipeline (it calls the model directly).
- At the end rank 0 prints a short sample of generated text and the absolute paths of the
  logs (``metrics.jsonl``) and checkpoints. ``examples/finetune.py`` starts from them.
"""

from __future__ import annotations

import glob
import os
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from pydantic import Field, PositiveInt, model_validator
from torch import nn
from torch.utils.data import DataLoader, Dataset
from typing_extensions import override

from dream_trainer import DreamTrainer, DreamTrainerConfig
from dream_trainer.callbacks import CallbackCollection, LRMonitor
from dream_trainer.configs import (CheckpointParameters, ConfigModel, DeviceParameters,
                                   LoggingParameters, TrainingParameters, apply_cli_overrides)

VOCAB_SIZE = 256  # one token per byte
STDLIB = Path(os.path.dirname(os.__file__))


# -- data ------------------------------------------------------------------------------------
def stdlib_text(pattern: str) -> bytes:
    """The standard library files matching ``pattern`` (sorted by path), concatenated.

    Raises:
        FileNotFoundError: if no file matches.
    """
    paths = sorted(glob.glob(pattern, root_dir=STDLIB))
    if not paths:
        raise FileNotFoundError(f"no standard library file matches {pattern!r} under {STDLIB}")
    return b"".join((STDLIB / path).read_bytes() for path in paths)


class ByteWindows(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Non-overlapping windows of ``context + 1`` bytes, as (input, next-byte target) pairs."""

    def __init__(self, data: bytes, context: int) -> None:
        self.tokens = torch.frombuffer(bytearray(data), dtype=torch.uint8).long()
        self.context = context

    def __len__(self) -> int:
        return (len(self.tokens) - 1) // self.context

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        start = index * self.context
        window = self.tokens[start:start + self.context + 1]
        return window[:-1], window[1:]


# -- model -----------------------------------------------------------------------------------
class GPTParameters(ConfigModel):
    """The shape of the model; a fine-tuning run must use the same values."""

    dim: PositiveInt = 128
    """Width of the residual stream."""
    n_layers: PositiveInt = 4
    """Transformer blocks, each one FSDP2 unit."""
    n_heads: PositiveInt = 4
    """Attention heads; must divide ``dim``."""
    context: PositiveInt = 128
    """Bytes the model sees at once (and the length of every training window)."""

    @model_validator(mode="after")
    def _heads_divide_dim(self) -> GPTParameters:
        if self.dim % self.n_heads:
            raise ValueError(f"n_heads={self.n_heads} does not divide dim={self.dim}: "
                             "choose a head count that does")
        return self


class CausalSelfAttention(nn.Module):
    def __init__(self, dim: int, n_heads: int) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.out = nn.Linear(dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, dim = x.shape
        # (batch, seq, 3 * dim) -> three (batch, heads, seq, head_dim) tensors
        q, k, v = self.qkv(x).view(batch, seq, 3, self.n_heads, -1).permute(2, 0, 3, 1, 4)
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(attended.transpose(1, 2).reshape(batch, seq, dim))


class Block(nn.Module):
    """Pre-norm transformer block: attention, then an MLP, each added to the residual."""

    def __init__(self, dim: int, n_heads: int) -> None:
        super().__init__()
        self.attn_norm = nn.LayerNorm(dim)
        self.attn = CausalSelfAttention(dim, n_heads)
        self.mlp_norm = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class CharGPT(nn.Module):
    """Byte embeddings, learned positions, ``n_layers`` blocks, a linear head to 256 logits."""

    def __init__(self, params: GPTParameters) -> None:
        super().__init__()
        self.token_embedding = nn.Embedding(VOCAB_SIZE, params.dim)
        self.position_embedding = nn.Embedding(params.context, params.dim)
        # A ModuleList of blocks: the default apply_fully_shard shards each one separately,
        # so only one block's full parameters exist at a time in forward and backward.
        self.blocks = nn.ModuleList(Block(params.dim, params.n_heads)
                                    for _ in range(params.n_layers))
        self.norm = nn.LayerNorm(params.dim)
        self.head = nn.Linear(params.dim, VOCAB_SIZE, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Modules that are None belong to other pipeline stages: a later stage receives the
        # previous stage's activations instead of tokens.
        if self.token_embedding is not None:
            positions = torch.arange(x.shape[1], device=x.device)
            x = self.token_embedding(x) + self.position_embedding(positions)
        for block in self.blocks:
            if block is not None:
                x = block(x)
        if self.head is not None:
            x = self.head(self.norm(x))
        return x


def next_byte_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of ``(batch, seq, 256)`` logits against ``(batch, seq)`` bytes."""
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


# -- trainer ---------------------------------------------------------------------------------
class CharGPTConfig(DreamTrainerConfig):
    gpt: GPTParameters = Field(default_factory=GPTParameters)
    """Model shape."""
    files: str = "[a-m]*.py"
    """Glob, relative to the standard library directory, of the files to train on."""
    val_fraction: float = Field(default=0.1, gt=0, lt=1)
    """Share of the text, taken from its end, used for validation."""
    learning_rate: float = Field(default=3e-3, gt=0)
    """Peak AdamW learning rate, reached after ``warmup_steps``."""
    warmup_steps: int = Field(default=30, ge=0)
    """Optimizer steps of linear learning-rate warmup."""
    weight_decay: float = Field(default=0.1, ge=0)
    """AdamW weight decay of the matrices (not of norms and biases)."""
    sample_length: int = Field(default=300, ge=0)
    """Bytes of text to generate at the end (0: none)."""
    sample_prompt: str = "def "
    """Text the generated sample continues."""


class CharGPTTrainer(DreamTrainer):
    config: CharGPTConfig

    def __init__(self, config: CharGPTConfig) -> None:
        super().__init__(config)
        self.val_losses: list[tuple[int, float]] = []
        self.sample = ""
        self._started = 0.0

    @override
    def configure_models(self) -> None:
        # Runs under torch.device("meta"): shapes only; FSDP2 shards them before any storage.
        self.model = CharGPT(self.config.gpt)

    @override
    def init_weights(self) -> None:
        # GPT-2's initialization. On sharded parameters each rank draws the full tensor and
        # keeps its shard, so the weights match a single-process run with the same seed.
        for module in self.model.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=0.02)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)

    @override
    def configure_optimizers(self) -> None:
        matrices = [p for p in self.model.parameters() if p.ndim >= 2]
        others = [p for p in self.model.parameters() if p.ndim < 2]
        self.optimizer = torch.optim.AdamW(
            [{"params": matrices, "weight_decay": self.config.weight_decay},
             {"params": others, "weight_decay": 0.0}],
            lr=self.config.learning_rate, betas=(0.9, 0.99))

    @override
    def configure_schedulers(self) -> None:
        # Stepped once per optimizer step by step(); it has no end, so a resumed run may
        # train for more epochs than the first one planned.
        warmup = self.config.warmup_steps
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda step: min(1.0, (step + 1) / warmup) if warmup else 1.0)

    @override
    def configure_dataloaders(self) -> tuple[DataLoader[Any], DataLoader[Any]]:
        text = stdlib_text(self.config.files)
        split = int(len(text) * (1 - self.config.val_fraction))
        context = self.config.gpt.context
        params = self.config.training_parameters
        # The trainer gives each data-parallel rank its share of both loaders, and reshuffles
        # the training windows every epoch from the seed (so resume reproduces the order).
        return (DataLoader(ByteWindows(text[:split], context), shuffle=True, drop_last=True,
                           batch_size=params.train_batch_size),
                DataLoader(ByteWindows(text[split:], context),
                           batch_size=params.val_batch_size))

    @override
    def training_step(self, batch: Any, batch_idx: int) -> dict[str, Any]:
        inputs, targets = batch
        # cross_entropy(model(inputs), targets) then backward(), or the pipeline schedule.
        loss = self.forward_backward(self.model, inputs, target=targets, loss_fn=next_byte_loss)
        if self.is_accumulating_gradients:
            return {"loss": loss}
        return {"loss": loss, "grad_norm": self.step(self.model, self.optimizer)}

    @override
    def validation_step(self, batch: Any, batch_idx: int) -> dict[str, Any]:
        inputs, targets = batch
        return {"val_loss": self.forward_loss(self.model, inputs, target=targets,
                                              loss_fn=next_byte_loss)}

    # -- what the example reports ---------------------------------------------------------------
    @override
    def pre_fit(self) -> None:
        super().pre_fit()
        self._started = time.perf_counter()
        if self.world.is_rank_zero:
            n_params = sum(p.numel() for p in self.model.parameters())
            held = "in rank 0's pipeline stage(s)" if self.world.dims.pp > 1 \
                else f"on {self.world.world_size} rank(s)"
            print(f"{n_params:,} parameters {held}; "
                  f"starting at step {self.global_step}", flush=True)
        # The loss before the first step (or, resumed, at the checkpoint), for comparison.
        self.evaluate(max_batches=self.config.training_parameters.val_steps_per_epoch)

    @override
    def post_val_epoch(self, result: dict[str, Any]) -> None:
        super().post_val_epoch(result)
        if self.sanity_checking:
            return
        # Already averaged over batches and ranks: every rank holds the same value.
        loss = float(result["val_loss"])
        self.val_losses.append((self.global_step, loss))
        if self.world.is_rank_zero:
            elapsed = time.perf_counter() - self._started
            print(f"step {self.global_step}: val_loss={loss:.4f} ({elapsed:.0f} s)", flush=True)

    @override
    def post_fit(self) -> None:
        super().post_fit()  # the final checkpoint is written here
        if self.config.sample_length and self.world.dims.pp == 1:
            self.sample = self.generate(self.config.sample_prompt, self.config.sample_length)

    @torch.no_grad()
    def generate(self, prompt: str, length: int, temperature: float = 0.8) -> str:
        """Continue ``prompt`` by ``length`` sampled bytes.

        Under FSDP2 every forward is a collective, so every rank must call this; a generator
        seeded the same on every rank keeps them drawing the same bytes.
        """
        context = self.config.gpt.context
        tokens = torch.tensor([list(prompt.encode())], device=self.world.device)
        generator = torch.Generator(device=self.world.device).manual_seed(0)
        for _ in range(length):
            logits = self.model(tokens[:, -context:])[0, -1] / temperature
            next_token = torch.multinomial(logits.softmax(dim=-1), 1, generator=generator)
            tokens = torch.cat([tokens, next_token[None]], dim=1)
        return bytes(tokens[0].tolist()).decode("utf-8", errors="replace")


def default_config() -> CharGPTConfig:
    """The run ``torchrun --standalone --nproc_per_node=2 examples/char_gpt.py`` trains."""
    return CharGPTConfig(
        project="examples", group="char_gpt", experiment="gpt",
        device_parameters=DeviceParameters.FSDP(),
        training_parameters=TrainingParameters(
            n_epochs=5, train_steps_per_epoch=40, train_batch_size=16, val_batch_size=32,
            val_steps_per_epoch=8, gradient_clip_val=1.0),
        checkpoint_parameters=CheckpointParameters(root_dir=Path("outputs"), every_n_epochs=1,
                                                   keep_top_k=2, monitor="val_loss"),
        logging_parameters=LoggingParameters(log_dir=Path("outputs"), log_every_n_steps=10),
        # No progress bar: the validation lines are the progress report.
        callbacks=CallbackCollection([LRMonitor()]),
    )


def make_trainer(args: list[str] | None = None) -> CharGPTTrainer:
    """The example's trainer, with ``args`` (default: the command line) as config overrides."""
    return CharGPTTrainer(apply_cli_overrides(default_config(), args, description=__doc__))


def report(trainer: CharGPTTrainer) -> None:
    """Print the sample and where the run wrote its logs and checkpoints (rank 0)."""
    if not trainer.world.is_rank_zero:
        return
    if trainer.sample:
        print(f"--- sample ---\n{trainer.sample}\n--------------")
    print(f"logs: {trainer.log_dir.resolve()}")
    print(f"checkpoints: {trainer.checkpoint_dir.resolve()}")


def run(trainer: CharGPTTrainer) -> None:
    """Train, then report (``moe_gpt.py`` runs its trainer the same way)."""
    trainer.fit()
    report(trainer)


def main() -> None:
    run(make_trainer())


if __name__ == "__main__":
    main()
