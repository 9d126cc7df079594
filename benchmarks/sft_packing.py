"""Supervised fine-tuning throughput: packed conversations against padded batches of the same.

The conversations of examples/sft.py (one to three turns of copying, reversing or sorting 2
to 16 digits, some with a system message: 10 to 130 tokens each), rendered once with its
ChatML tokenizer by ``ChatDataset``, train a tiny transformers Llama (AdamW, one process, one
CPU thread) for one pass in two ways:

- packed: ``ShardedStream(documents=True)`` sequences of ``sequence_length`` tokens, the model
  run inside ``self.documents(...)`` (attention masked by conversation, positions restarting);
- padded: batches of ``batch`` conversations collated by ``pad_chat`` (right padding to the
  batch's longest), the model given the ``attention_mask``.

The packed batch holds about as many tokens as a padded batch holds conversation tokens
(``round(batch x mean length / sequence_length)`` sequences), so both take about the same
number of steps per pass. The loss is summed over the assistant tokens and ``num_items`` is
their count in both. The figure is trained (assistant) tokens per second of the optimizer
steps after ``WARMUP`` (forward, backward, step; the conversations are rendered before the
timing, so the loaders only pack or pad): each trial runs both, alternating which goes first;
the ratio packed / padded is the median of the per-trial ratios. Also reported: the share of
padding among the padded batches' positions.

    python -m benchmarks.sft_packing [--conversations 256] [--trials 5] [--json out.json]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import random
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

from dream_trainer import BaseTrainer, BaseTrainerConfig
from dream_trainer.configs import TrainingParameters
from dream_trainer.data import ChatDataset, ShardedStream
from dream_trainer.data.chat import pad_chat, trained_tokens
from dream_trainer.mixins import SetupConfigMixin, SetupMixin

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "sft.py"
WARMUP = 2
"""Optimizer steps of each pass left out of the timing."""


@dataclass(frozen=True)
class Shape:
    """The tiny Llama trained, and the batches."""

    hidden: int = 64
    layers: int = 2
    intermediate: int = 172
    heads: int = 4
    kv_heads: int = 2
    sequence_length: int = 256
    """Tokens per packed sequence."""
    batch: int = 16
    """Conversations per padded batch."""


QUICK = Shape(hidden=32, layers=1, intermediate=64, sequence_length=64, batch=4)


def example() -> Any:
    """examples/sft.py as a module: its tokenizer and conversations."""
    spec = importlib.util.spec_from_file_location("sft_example", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class SFTBenchConfig(BaseTrainerConfig, SetupConfigMixin):
    shape: Shape
    packed: bool
    samples: list[dict[str, list[int]]]
    """The rendered conversations."""
    vocab: int
    pad_token_id: int


class SFTBench(BaseTrainer, SetupMixin):
    """One pass over the conversations, packed or padded; records each optimizer step's
    seconds and trained tokens."""

    config: SFTBenchConfig

    def configure_models(self) -> None:
        from transformers import LlamaConfig, LlamaForCausalLM

        shape = self.config.shape
        torch.manual_seed(0)
        self.model = LlamaForCausalLM(LlamaConfig(
            vocab_size=self.config.vocab, hidden_size=shape.hidden,
            intermediate_size=shape.intermediate, num_hidden_layers=shape.layers,
            num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads,
            max_position_embeddings=max(shape.sequence_length, 256), use_cache=False))
        self.times: list[float] = []
        self.tokens: list[int] = []
        self.positions: list[int] = []
        self.real: list[int] = []

    def configure_optimizers(self) -> None:
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-3)

    def configure_dataloaders(self) -> tuple[DataLoader[Any], None]:
        samples, shape = self.config.samples, self.config.shape
        if not self.config.packed:
            pad = self.config.pad_token_id
            return DataLoader(samples, batch_size=self.config.training_parameters.train_batch_size,
                              shuffle=True, drop_last=True,
                              collate_fn=lambda rows: pad_chat(rows, pad_token_id=pad)), None
        stream = ShardedStream(samples, sequence_length=shape.sequence_length, documents=True,
                               labels=lambda sample: sample["labels"])
        return DataLoader(stream,
                          batch_size=self.config.training_parameters.train_batch_size), None

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> dict[str, Any]:
        start = time.perf_counter()
        if self.config.packed:
            targets = batch["targets"]
            with self.documents(batch["document_ids"], batch["position_ids"]):
                logits = self.model(batch["input_ids"]).logits
                loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten(),
                                       reduction="sum")
                trained = trained_tokens(targets)
                self.backward(loss, num_items=trained)
        else:
            targets = batch["labels"][:, 1:]  # token i predicts token i + 1
            logits = self.model(batch["input_ids"],
                                attention_mask=batch["attention_mask"]).logits[:, :-1]
            loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum")
            trained = trained_tokens(targets)
            self.backward(loss, num_items=trained)
        self.step(self.model, self.optimizer)
        self.times.append(time.perf_counter() - start)
        self.tokens.append(int(trained))
        self.positions.append(batch["input_ids"].numel())
        mask = batch.get("attention_mask")
        self.real.append(self.positions[-1] if mask is None else int(mask.sum()))
        return {"loss": loss.detach() / trained}

    def validation_step(self, batch: Any, batch_idx: int) -> dict[str, Any]:
        return {}


def packed_batch(samples: list[dict[str, list[int]]], shape: Shape) -> int:
    """Packed sequences per batch: about the tokens of a padded batch's conversations."""
    mean = sum(len(sample["input_ids"]) for sample in samples) / len(samples)
    return max(1, round(shape.batch * mean / shape.sequence_length))


def run(samples: list[dict[str, list[int]]], shape: Shape, packed: bool, vocab: int,
        pad_token_id: int) -> dict[str, Any]:
    """One pass, packed or padded: trained tokens per second after the warm-up, and the
    share of padding among all its batches' positions."""
    total = sum(len(sample["input_ids"]) for sample in samples)
    batch = packed_batch(samples, shape) if packed else shape.batch
    steps = total // (shape.sequence_length * batch) if packed else len(samples) // batch
    trainer = SFTBench(SFTBenchConfig(
        project="bench", group="sft_packing", experiment="packed" if packed else "padded",
        shape=shape, packed=packed, samples=samples, vocab=vocab, pad_token_id=pad_token_id,
        training_parameters=TrainingParameters(n_epochs=None, max_steps=steps,
                                               train_batch_size=batch)))
    trainer.fit()
    timed = slice(WARMUP, None)
    return {"steps": steps, "trained_tokens": sum(trainer.tokens[timed]),
            "positions": sum(trainer.positions[timed]),
            "seconds": sum(trainer.times[timed]),
            "tokens_per_second": sum(trainer.tokens[timed]) / sum(trainer.times[timed]),
            "padding_share": 1 - sum(trainer.real) / sum(trainer.positions)}


def measure(conversations: int = 256, trials: int = 5, shape: Shape = Shape()
            ) -> dict[str, Any]:
    """Trained tokens per second, packed and padded, on the same conversations, on one
    CPU thread (the figure then depends less on what else runs on the machine's cores)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return measured(conversations, trials, shape)
    finally:
        torch.set_num_threads(threads)


def measured(conversations: int, trials: int, shape: Shape) -> dict[str, Any]:
    sft = example()
    tokenizer = sft.build_tokenizer()
    draw = random.Random(0)
    dataset = ChatDataset([{"messages": sft.conversation(draw)} for _ in range(conversations)],
                          tokenizer)
    samples = [dataset[index] for index in range(len(dataset))]
    if min(len(samples) // shape.batch, sum(dataset.lengths) // (
            shape.sequence_length * packed_batch(samples, shape))) <= WARMUP:
        raise ValueError(f"{conversations} conversations make too few steps for a warm-up of "
                         f"{WARMUP}: give more conversations or smaller batches")
    runs: dict[str, list[dict[str, Any]]] = {"packed": [], "padded": []}
    for trial in range(trials):
        order = ("packed", "padded") if trial % 2 == 0 else ("padded", "packed")
        for kind in order:
            runs[kind].append(run(samples, shape, kind == "packed", len(tokenizer),
                                  tokenizer.pad_token_id))
    ratios = [p["tokens_per_second"] / q["tokens_per_second"]
              for p, q in zip(runs["packed"], runs["padded"])]
    lengths = dataset.lengths
    return {
        "conversations": conversations, "shape": asdict(shape),
        "packed_batch": packed_batch(samples, shape), "threads": torch.get_num_threads(),
        "tokens": sum(lengths), "mean_length": sum(lengths) / len(lengths),
        "trained_tokens_per_pass": sum(int(trained_tokens(torch.tensor(s["labels"])))
                                       for s in samples),
        # Every trial's padded pass reads the same shuffled batches (the trainer's seed).
        "padding_share": runs["padded"][0]["padding_share"],
        "packed": summary(runs["packed"]), "padded": summary(runs["padded"]),
        "ratio_packed_to_padded": {"median": statistics.median(ratios), "min": min(ratios),
                                   "max": max(ratios)},
    }


def summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    rates = [r["tokens_per_second"] for r in runs]
    return {"tokens_per_second": {"median": statistics.median(rates), "min": min(rates),
                                  "max": max(rates)},
            "steps": runs[0]["steps"], "timed_trained_tokens": runs[0]["trained_tokens"],
            "timed_positions": runs[0]["positions"]}


def markdown(result: dict[str, Any]) -> list[str]:
    shape = result["shape"]
    where = (f"CPU, {result['conversations']} conversations, Llama {shape['layers']}x"
             f"{shape['hidden']}")
    packed, padded = result["packed"], result["padded"]
    return [
        f"| {where}: packed ({result['packed_batch']} x {shape['sequence_length']} tokens) | "
        f"{packed['tokens_per_second']['median']:,.0f} trained tokens/s |",
        f"| {where}: padded ({shape['batch']} conversations, {result['padding_share']:.0%} "
        f"padding) | {padded['tokens_per_second']['median']:,.0f} trained tokens/s |",
        f"| {where}: packed / padded trained tokens/s | "
        f"{result['ratio_packed_to_padded']['median']:.2f} |",
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--conversations", type=int, default=256)
    parser.add_argument("--trials", type=int, default=5)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    result = measure(args.conversations, args.trials)
    print("\n".join(markdown(result)))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
