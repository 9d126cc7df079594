"""A word-level LSTM language model with truncated backpropagation through time (TBPTT),
carrying its hidden state from batch to batch, on the Python standard library's own text.

    python examples/word_lm.py
    torchrun --standalone --nproc_per_node=2 examples/word_lm.py
    python examples/word_lm.py --checkpoint_parameters.resume latest   # after a kill

The text is always on disk: the standard library modules matching ``files`` (a glob relative
to the directory of ``os.py``, sorted), split on whitespace into words; the ``vocab_size - 1``
most frequent words get their own token and every other word is ``<unk>``. The last
``val_fraction`` of the words is the validation text.

What it shows:

- State carried across batches. As in pytorch/examples' word_language_model, the word
  stream is cut into ``rows`` parallel streams (``train_batch_size`` per rank, over every
  data-parallel rank); batch ``k`` holds window ``k`` (``bptt`` words) of each of this rank's
  streams, and the LSTM starts each window from the hidden state the previous one ended with
  (detached, so backpropagation stops at the window's start).
- Where the carried state lives across a kill: ``rank_state_dict()`` saves each process's
  hidden state in every checkpoint and gives it back to the same process on resume (each
  rank carries other streams). The state is reset when an epoch starts: ``batch_idx`` is 0
  then, while a resumed epoch continues from the batch after the checkpoint's.
- Bit-exact resume: kill it (even with SIGKILL) and run the same command with
  ``--checkpoint_parameters.resume latest``; it ends with the weights of an uninterrupted
  run, on 1 and on 2 ranks (``tests/examples/test_word_lm.py`` checks both).
"""

from __future__ import annotations

import collections
import glob
import os
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from pydantic import Field, PositiveInt
from torch import nn
from torch.utils.data import DataLoader, Dataset
from typing_extensions import override

from dream_trainer import DreamTrainer, DreamTrainerConfig
from dream_trainer.configs import (CheckpointParameters, LoggingParameters, TrainingParameters,
                                   apply_cli_overrides)

STDLIB = Path(os.path.dirname(os.__file__))
UNKNOWN = 0  # the token of every word outside the vocabulary


# -- data ------------------------------------------------------------------------------------
def stdlib_words(pattern: str) -> list[str]:
    """The words (whitespace-separated) of the standard library files matching ``pattern``.

    Raises:
        FileNotFoundError: if no file matches.
    """
    paths = sorted(glob.glob(pattern, root_dir=STDLIB))
    if not paths:
        raise FileNotFoundError(f"no standard library file matches {pattern!r} under {STDLIB}")
    return [word for path in paths
            for word in (STDLIB / path).read_text(encoding="utf-8", errors="replace").split()]


def tokenize(words: list[str], vocab_size: int) -> torch.Tensor:
    """Each word's token: the ``vocab_size - 1`` most frequent words by rank, others unknown."""
    ranked = collections.Counter(words).most_common(vocab_size - 1)
    index = {word: token for token, (word, _) in enumerate(ranked, start=1)}
    return torch.tensor([index.get(word, UNKNOWN) for word in words])


class Streams(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """``rows`` parallel streams of one token sequence, cut into windows of ``bptt`` tokens.

    Item ``i`` is window ``i // rows`` of stream ``i % rows``, as an (inputs, next-token
    targets) pair. Read in order and split over ``R`` data-parallel ranks item by item (rank
    ``r`` reads items ``r, r + R, ...``), a batch of ``rows / R`` items holds one window of
    each of that rank's streams, the same streams in every batch, windows in order.
    """

    def __init__(self, tokens: torch.Tensor, rows: int, bptt: int) -> None:
        length = (len(tokens) - 1) // rows
        self.inputs = tokens[:length * rows].view(rows, length)
        self.targets = tokens[1:length * rows + 1].view(rows, length)
        self.rows, self.bptt = rows, bptt
        self.windows = length // bptt

    def __len__(self) -> int:
        return self.windows * self.rows

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        window, row = divmod(index, self.rows)
        span = slice(window * self.bptt, (window + 1) * self.bptt)
        return self.inputs[row, span], self.targets[row, span]


# -- model -----------------------------------------------------------------------------------
Hidden = tuple[torch.Tensor, torch.Tensor]


class WordLSTM(nn.Module):
    """Embedding, a multi-layer LSTM, and a linear head, with dropout between them."""

    def __init__(self, vocab_size: int, dim: int, layers: int, dropout: float) -> None:
        super().__init__()
        self.embedding = nn.Embedding(vocab_size, dim)
        self.lstm = nn.LSTM(dim, dim, layers, dropout=dropout, batch_first=True)
        self.dropout = nn.Dropout(dropout)
        self.head = nn.Linear(dim, vocab_size)

    def forward(self, tokens: torch.Tensor,
                hidden: Hidden | None = None) -> tuple[torch.Tensor, Hidden]:
        output, hidden = self.lstm(self.dropout(self.embedding(tokens)), hidden)
        return self.head(self.dropout(output)), hidden


# -- trainer ---------------------------------------------------------------------------------
class WordLMConfig(DreamTrainerConfig):
    files: str = "[a-c]*.py"
    """Glob, relative to the standard library directory, of the files to read."""
    vocab_size: PositiveInt = 2000
    """Tokens, ``<unk>`` included."""
    val_fraction: float = Field(default=0.1, gt=0, lt=1)
    """Share of the words, from the end, used for validation."""
    bptt: PositiveInt = 35
    """Words per window: how far back each backward pass reaches."""
    dim: PositiveInt = 128
    """Embedding and LSTM width."""
    layers: PositiveInt = 2
    """LSTM layers."""
    dropout: float = Field(default=0.2, ge=0, lt=1)
    """Dropout on the embeddings, between LSTM layers and before the head."""
    learning_rate: float = Field(default=1e-3, gt=0)
    """Adam learning rate."""


class WordLMTrainer(DreamTrainer):
    config: WordLMConfig

    def __init__(self, config: WordLMConfig) -> None:
        super().__init__(config)
        self.hidden: Hidden | None = None  # the training streams' carried state
        self.val_hidden: Hidden | None = None
        self.val_losses: list[float] = []

    @override
    def configure_models(self) -> None:
        config = self.config
        self.model = WordLSTM(config.vocab_size, config.dim, config.layers, config.dropout)

    @override
    def configure_optimizers(self) -> None:
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=self.config.learning_rate)

    @override
    def configure_dataloaders(self) -> tuple[DataLoader[Any], DataLoader[Any]]:
        tokens = tokenize(stdlib_words(self.config.files), self.config.vocab_size)
        split = int(len(tokens) * (1 - self.config.val_fraction))
        params = self.config.training_parameters
        dp = self.world.dp_size
        # In order (no shuffling): the trainer splits the items over the ranks, so that each
        # rank's batches continue its own streams.
        return (DataLoader(Streams(tokens[:split], params.train_batch_size * dp,
                                   self.config.bptt), batch_size=params.train_batch_size),
                DataLoader(Streams(tokens[split:], params.val_batch_size * dp,
                                   self.config.bptt), batch_size=params.val_batch_size))

    @override
    def training_step(self, batch: Any, batch_idx: int) -> dict[str, Any]:
        inputs, targets = batch
        if batch_idx == 0:
            self.hidden = None  # a new epoch starts the streams from the beginning
        logits, hidden = self.model(inputs, self.hidden)
        self.hidden = (hidden[0].detach(), hidden[1].detach())
        loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
        self.backward(loss)
        grad_norm = self.step(self.model, self.optimizer)
        return {"loss": loss, "grad_norm": grad_norm}

    @override
    def validation_step(self, batch: Any, batch_idx: int) -> dict[str, Any]:
        inputs, targets = batch
        if batch_idx == 0:
            self.val_hidden = None
        logits, self.val_hidden = self.model(inputs, self.val_hidden)
        return {"val_loss": F.cross_entropy(logits.flatten(0, 1), targets.flatten())}

    @override
    def post_val_epoch(self, result: dict[str, Any]) -> None:
        super().post_val_epoch(result)
        if not self.sanity_checking and self.world.is_rank_zero:
            self.val_losses.append(float(result["val_loss"]))
            print(f"epoch {self.current_epoch}: val_loss={result['val_loss']:.3f} "
                  f"(step {self.global_step})", flush=True)

    # Each process carries its own streams' state: saved per rank, restored to the same rank.
    @override
    def rank_state_dict(self) -> dict[str, Any]:
        return {**super().rank_state_dict(), "hidden": self.hidden}

    @override
    def load_rank_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_rank_state_dict(state_dict)
        self.hidden = state_dict["hidden"]


def default_config() -> WordLMConfig:
    """The run ``python examples/word_lm.py`` trains (a few minutes on 2 CPU cores)."""
    return WordLMConfig(
        project="examples", group="word_lm", experiment="lstm",
        training_parameters=TrainingParameters(n_epochs=3, train_batch_size=16,
                                               val_batch_size=16, gradient_clip_val=0.5),
        checkpoint_parameters=CheckpointParameters(root_dir=Path("outputs"), every_n_steps=50),
        logging_parameters=LoggingParameters(log_dir=Path("outputs")),
        callbacks=[],
    )


def make_trainer(args: list[str] | None = None) -> WordLMTrainer:
    """The example's trainer, with ``args`` (default: the command line) as config overrides."""
    return WordLMTrainer(apply_cli_overrides(default_config(), args, description=__doc__))


def main() -> None:
    trainer = make_trainer()
    trainer.fit()
    if trainer.world.is_rank_zero:
        print(f"checkpoints: {trainer.checkpoint_dir.resolve()}")


if __name__ == "__main__":
    main()
