"""Supervised fine-tuning of a Hugging Face chat model on packed conversations, and its export.

    pip install -e ".[hf]"        # transformers and tokenizers: this example's only extras
    python examples/sft.py
    torchrun --standalone --nproc_per_node=2 examples/sft.py       # FSDP2 over 2 ranks
    torchrun --standalone --nproc_per_node=2 examples/sft.py \\
        --device_parameters.dp_shard 1 --device_parameters.tensor_parallel 2
    python examples/sft.py --init_weights_from path/to/a/save_pretrained/directory \\
        --chats my_chats.jsonl --val_chats my_val_chats.jsonl

Nothing is downloaded. Unless ``--init_weights_from`` names a directory, the first run
creates a small Llama and its tokenizer in ``outputs/examples/sft/pretrained``: the stand-in
for a chat model from the Hub (``config.json`` and random weights written by
``save_pretrained``, and a word-level tokenizer built with ``tokenizers`` whose
``chat_template`` is ChatML). Unless ``--chats`` and ``--val_chats`` name files, it also
writes two JSONL files of conversations (one ``{"messages": [...]}`` object per line) in which
the assistant copies, reverses or sorts the digits the user gives, over one to three turns,
some with a system message.

What it shows:

- ``configure_dataloaders`` reads the JSONL files through ``ChatDataset`` (rendered with the
  tokenizer's chat template, labels ``-100`` off the assistant turns) and packs them with
  ``ShardedStream(documents=True)``: each sequence holds several conversations, with each
  token's position in its conversation, its conversation, and its shifted target (never the
  next conversation's first token).
- ``training_step`` runs the model inside ``self.documents(...)``: attention stays inside each
  conversation and transformers' Llama gets the restarting positions, its code unchanged.
  The loss is summed over the trained (assistant) tokens and ``num_items`` is their count, so
  one process and 2 FSDP2 ranks train on the same mean.
- At the end ``export_weights`` writes the fine-tuned weights in the Hugging Face layout to
  ``outputs/examples/sft/exported``, with the tokenizer beside them; rank 0 loads them with
  ``AutoModelForCausalLM.from_pretrained``, prints how far its logits are from the trained
  model's (0 up to float rounding), and answers a held-out prompt with ``generate``.

This step calls the model itself, so it runs on one process, DDP, FSDP2, HSDP and tensor
parallelism; pipelines and context parallelism run packed documents too when the model is
called through ``forward_backward`` inside ``self.documents`` (docs/finetuning.md).
"""

from __future__ import annotations

import json
import os
import random
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from pydantic import Field, PositiveInt
from torch.distributed.device_mesh import DeviceMesh
from torch.utils.data import DataLoader
from typing_extensions import override

from dream_trainer import DreamTrainer, DreamTrainerConfig
from dream_trainer.callbacks import CallbackCollection
from dream_trainer.configs import (CheckpointParameters, ConfigModel, DeviceParameters,
                                   LoggingParameters, TrainingParameters, apply_cli_overrides)
from dream_trainer.data import ChatDataset, ShardedStream
from dream_trainer.data.chat import trained_tokens

OUTPUTS = Path("outputs/examples/sft")
SPECIAL = ["<unk>", "<pad>", "<|im_start|>", "<|im_end|>"]
TASKS = {"copy": lambda digits: digits, "reverse": lambda digits: digits[::-1],
         "sort": sorted}
SYSTEM = "you are a careful assistant answer with digits only"
WORDS = [*SPECIAL, "system", "user", "assistant", *TASKS, *SYSTEM.split(),
         *(str(d) for d in range(10))]
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


class LlamaShape(ConfigModel):
    """The shape of the stand-in pretrained model (used only when it is created)."""

    hidden_size: PositiveInt = 128
    intermediate_size: PositiveInt = 344
    num_hidden_layers: PositiveInt = 4
    num_attention_heads: PositiveInt = 4
    num_key_value_heads: PositiveInt = 2
    context: PositiveInt = 256
    """Tokens per packed sequence, and the stand-in's maximum position."""


class SFTConfig(DreamTrainerConfig):
    llama: LlamaShape = Field(default_factory=LlamaShape)
    """Shape of the stand-in pretrained model."""
    chats: Path = OUTPUTS / "chats.jsonl"
    """JSONL of training conversations; written (3000 of them) when this default is missing."""
    val_chats: Path = OUTPUTS / "val_chats.jsonl"
    """JSONL of validation conversations; written (200) when this default is missing."""
    tokenizer: Path | None = None
    """Directory of the tokenizer (with a chat template); by default ``init_weights_from``."""
    learning_rate: float = Field(default=3e-3, gt=0)
    """AdamW learning rate."""
    export_dir: Path = OUTPUTS / "exported"
    """Where the fine-tuned weights and the tokenizer are written in the Hugging Face layout."""


class SFTTrainer(DreamTrainer):
    config: SFTConfig

    def __init__(self, config: SFTConfig) -> None:
        super().__init__(config)
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(config.tokenizer
                                                       or config.init_weights_from)
        self.val_losses: list[tuple[int, float]] = []

    @override
    def configure_models(self) -> None:
        from transformers import AutoConfig, AutoModelForCausalLM

        # Runs on the meta device: no memory, no initialization until the model is sharded.
        config = AutoConfig.from_pretrained(self.config.init_weights_from)
        self.model = AutoModelForCausalLM.from_config(config)

    @override
    def apply_tensor_parallel(self, tp_mesh: DeviceMesh) -> None:
        from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                       parallelize_module)

        # As in finetune_hf.py: whole heads on each rank, o_proj and down_proj add them up.
        plan = {"self_attn.q_proj": ColwiseParallel(), "self_attn.k_proj": ColwiseParallel(),
                "self_attn.v_proj": ColwiseParallel(), "self_attn.o_proj": RowwiseParallel(),
                "mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel(),
                "mlp.down_proj": RowwiseParallel()}
        for layer in self.model.model.layers:
            parallelize_module(layer, tp_mesh, plan)

    @override
    def configure_optimizers(self) -> None:
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=self.config.learning_rate)

    def packed(self, path: Path, seed: int) -> ShardedStream:
        """The conversations of ``path``, packed into sequences of ``llama.context`` tokens."""
        chats = ChatDataset(path, self.tokenizer)
        # A conversation longer than a sequence is split over several (its positions go on).
        return ShardedStream(chats, seed=seed, sequence_length=self.config.llama.context,
                             lengths=chats.lengths, documents=True,
                             labels=lambda sample: sample["labels"])

    @override
    def configure_dataloaders(self) -> tuple[DataLoader[Any], DataLoader[Any]]:
        params = self.config.training_parameters
        return (DataLoader(self.packed(self.config.chats, seed=0),
                           batch_size=params.train_batch_size),
                DataLoader(self.packed(self.config.val_chats, seed=1),
                           batch_size=params.val_batch_size))

    def summed_loss(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """The cross-entropy summed over the batch's trained targets, and their count; call
        inside ``self.documents``."""
        logits = self.model(batch["input_ids"]).logits
        targets = batch["targets"]
        loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(),
                               reduction="sum")
        return loss, trained_tokens(targets)

    @override
    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> dict[str, Any]:
        # Backward inside the context too: activation checkpointing recomputes attention there.
        with self.documents(batch["document_ids"], batch["position_ids"]):
            loss, trained = self.summed_loss(batch)
            self.backward(loss, num_items=trained)
        # The mean over this rank's trained tokens, for the logs; the update uses the global one.
        mean = loss.detach() / trained.clamp(min=1)
        if self.is_accumulating_gradients:
            return {"loss": mean}
        return {"loss": mean, "grad_norm": self.step(self.model, self.optimizer)}

    @override
    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int
                        ) -> dict[str, Any]:
        with self.documents(batch["document_ids"], batch["position_ids"]):
            loss, trained = self.summed_loss(batch)
        return {"val_loss": loss / trained.clamp(min=1)}

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
        # example replaces the export of the previous one.
        self.export_weights(self.config.export_dir, overwrite=True)
        # One held-out conversation, alone: every rank runs the trained model (FSDP2 gathers).
        chat = ChatDataset(self.config.val_chats, self.tokenizer)[0]
        inputs = torch.tensor([chat["input_ids"]], device=self.world.device)
        self.model.eval()
        with torch.no_grad():
            trained = self.model(inputs).logits.float().cpu()
        if self.world.is_rank_zero:
            self.tokenizer.save_pretrained(self.config.export_dir)
            self.check_export(inputs.cpu(), trained)

    def check_export(self, inputs: torch.Tensor, trained: torch.Tensor) -> None:
        """Load the export as a user would, compare its logits with the trained model's and
        answer the first held-out prompt."""
        from transformers import AutoModelForCausalLM, AutoTokenizer

        exported = AutoModelForCausalLM.from_pretrained(self.config.export_dir)
        tokenizer = AutoTokenizer.from_pretrained(self.config.export_dir)
        with torch.no_grad():
            logits = exported(inputs).logits.float()
        print(f"exported: {self.config.export_dir.resolve()} (from_pretrained's logits "
              f"differ by {(logits - trained).abs().max():.2e})")
        messages = ChatDataset(self.config.val_chats, tokenizer).messages(0)
        prompt = tokenizer.apply_chat_template(list(messages[:-1]), tokenize=True,
                                               add_generation_prompt=True,
                                               return_tensors="pt", return_dict=True)
        generated = exported.generate(**prompt, max_new_tokens=24, do_sample=False,
                                      eos_token_id=tokenizer.eos_token_id,
                                      pad_token_id=tokenizer.pad_token_id)
        answer = tokenizer.decode(generated[0, prompt["input_ids"].size(1):],
                                  skip_special_tokens=True)
        print(f"prompt: {messages[-2]['content']!r} -> answer: {answer!r} "
              f"(expected {messages[-1]['content']!r})")


def write_atomically(path: Path, write: Callable[[Path], None]) -> None:
    """Create ``path`` with ``write(staging)`` unless it exists. Under torchrun every rank may
    get here first: each writes a complete copy (seeded, so the same) to a name of its own and
    renames it into place; the first rename wins and the others are discarded."""
    if path.exists():
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}."))
    write(staging)
    source = staging / path.name if (staging / path.name).exists() else staging
    try:
        os.rename(source, path)
    except OSError:  # another rank's copy is already in place
        pass
    shutil.rmtree(staging, ignore_errors=True)


def build_tokenizer() -> Any:
    """A word-level tokenizer of the conversations' words, with a ChatML chat template."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocabulary = {word: index for index, word in enumerate(dict.fromkeys(WORDS))}
    backend = Tokenizer(models.WordLevel(vocabulary, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>",
                                        pad_token="<pad>", eos_token="<|im_end|>",
                                        additional_special_tokens=SPECIAL[2:])
    tokenizer.chat_template = CHATML
    return tokenizer


def ensure_pretrained(path: Path, shape: LlamaShape) -> None:
    """Create the stand-in pretrained model and its tokenizer at ``path`` unless a model is
    there already."""
    def write(staging: Path) -> None:
        from transformers import LlamaConfig, LlamaForCausalLM

        tokenizer = build_tokenizer()
        config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=shape.hidden_size,
                             intermediate_size=shape.intermediate_size,
                             num_hidden_layers=shape.num_hidden_layers,
                             num_attention_heads=shape.num_attention_heads,
                             num_key_value_heads=shape.num_key_value_heads,
                             max_position_embeddings=shape.context,
                             pad_token_id=tokenizer.pad_token_id,
                             eos_token_id=tokenizer.eos_token_id, tie_word_embeddings=False)
        torch.manual_seed(0)
        LlamaForCausalLM(config).save_pretrained(staging)
        tokenizer.save_pretrained(staging)

    write_atomically(path, write)


def conversation(draw: random.Random) -> list[dict[str, str]]:
    """One to three turns of a task on 2 to 16 digits, some with a system message."""
    messages = [{"role": "system", "content": SYSTEM}] if draw.random() < 0.3 else []
    for _ in range(draw.randint(1, 3)):
        task = draw.choice(list(TASKS))
        digits = [str(draw.randrange(10)) for _ in range(draw.randint(2, 16))]
        messages += [{"role": "user", "content": " ".join([task, *digits])},
                     {"role": "assistant", "content": " ".join(TASKS[task](digits))}]
    return messages


def ensure_chats(path: Path, count: int, seed: int) -> None:
    """Write ``count`` conversations to the JSONL file ``path`` unless it exists."""
    def write(staging: Path) -> None:
        draw = random.Random(seed)
        (staging / path.name).write_text("".join(
            json.dumps({"messages": conversation(draw)}) + "\n" for _ in range(count)))

    write_atomically(path, write)


def default_config() -> SFTConfig:
    """The run ``torchrun --standalone --nproc_per_node=2 examples/sft.py`` trains."""
    return SFTConfig(
        project="examples", group="sft", experiment="llama",
        init_weights_from=OUTPUTS / "pretrained",
        device_parameters=DeviceParameters.FSDP(),
        training_parameters=TrainingParameters(
            n_epochs=2, train_steps_per_epoch=30, train_batch_size=8, val_batch_size=8,
            val_steps_per_epoch=4, gradient_clip_val=1.0),
        checkpoint_parameters=CheckpointParameters(root_dir=Path("outputs"), keep_top_k=1),
        logging_parameters=LoggingParameters(log_dir=Path("outputs"), log_every_n_steps=10),
        callbacks=CallbackCollection([]),
    )


def make_trainer(args: list[str] | None = None) -> SFTTrainer:
    """The example's trainer, with ``args`` (default: the command line) as config overrides;
    creates the stand-in pretrained model and tokenizer when ``init_weights_from`` is the
    default, and the conversations when ``chats`` or ``val_chats`` is."""
    config = apply_cli_overrides(default_config(), args, description=__doc__)
    defaults = default_config()
    if config.init_weights_from == defaults.init_weights_from:
        ensure_pretrained(OUTPUTS / "pretrained", config.llama)
    if config.chats == defaults.chats:
        ensure_chats(config.chats, count=3000, seed=0)
    if config.val_chats == defaults.val_chats:
        ensure_chats(config.val_chats, count=200, seed=1)
    return SFTTrainer(config)


def main() -> None:
    trainer = make_trainer()
    trainer.fit()
    if trainer.world.is_rank_zero:
        (_, before), (step, after) = trainer.val_losses[0], trainer.val_losses[-1]
        print(f"val_loss before fine-tuning={before:.4f}, after {step} steps={after:.4f}")
        print(f"checkpoints: {trainer.checkpoint_dir.resolve()}")


if __name__ == "__main__":
    main()
