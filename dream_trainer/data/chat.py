"""Conversations rendered with a tokenizer's chat template, the loss on assistant turns only.

A chat template writes each message as a role header, its content and an end-of-turn marker
(ChatML: ``<|im_start|>assistant\\n`` ... ``<|im_end|>\\n``). Only some templates mark the
assistant's part with ``{% generation %}``, so the assistant spans are found from the template
itself, rendered on prefixes of the conversation: the first ``k`` messages with the generation
prompt end where assistant message ``k``'s content starts, the first ``k + 1`` messages end
where its turn ends. This holds only when every prefix's tokens are a prefix of the whole
conversation's tokens, which is checked for every span, so a template that formats a turn
differently once later turns follow is refused instead of mislabelled.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import torch
from torch.utils.data import Dataset

from dream_trainer.data.documents import IGNORE
from dream_trainer.data.jsonl import Records

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

IGNORE_INDEX = IGNORE
"""The label of a token the loss ignores (``data.documents.IGNORE``, -100)."""

ROLES = ("system", "user", "assistant", "tool")
"""The message roles a conversation may hold."""

Overflow = Literal["truncate", "error"]


def render_chat(tokenizer: PreTrainedTokenizerBase, messages: Sequence[Mapping[str, Any]], *,
                max_length: int | None = None, overflow: Overflow = "truncate",
                template_kwargs: Mapping[str, Any] | None = None,
                sample: str = "the conversation") -> dict[str, list[int]]:
    """Token ids and labels of one conversation, rendered with ``tokenizer``'s chat template.

    The labels equal the ids on each assistant message's content and the end-of-turn tokens
    the template writes after it (up to the next message's header), and are ``-100`` on
    everything else: system, user and tool messages, and the role headers. ``labels[i]`` is
    the target of ``input_ids[i]`` itself (transformers' convention: the model shifts by one).

    Args:
        tokenizer: A transformers tokenizer with a ``chat_template``.
        messages: ``{"role", "content"}`` mappings; roles ``system``, ``user``, ``assistant``,
            ``tool``; content a string. Other keys reach the template unchanged.
        max_length: At most this many tokens (None: no limit).
        overflow: Beyond ``max_length``: ``"truncate"`` drops the tokens past it (a
            conversation left with no assistant token is refused), ``"error"`` refuses.
        template_kwargs: Extra variables for the template (``enable_thinking=False``, ...).
        sample: How errors name this conversation (``"sample 3 (chats.jsonl line 4)"``).

    Returns:
        ``{"input_ids": [...], "labels": [...]}``, two lists of ints of one length.

    Raises:
        ValueError: for a tokenizer without a chat template; an empty conversation, one
            without an assistant message or starting with one; a message that is not a
            mapping, lacks ``role``/``content``, has an unknown role or non-string content;
            a template whose prefixes do not render as prefixes of the conversation; a
            conversation over ``max_length`` that ``overflow`` refuses.
    """
    check_chat_template(tokenizer)
    _check_messages(messages, sample)
    extra = dict(template_kwargs or {})

    def ids(count: int, prompt: bool) -> list[int]:
        return list(tokenizer.apply_chat_template(
            list(messages[:count]), tokenize=True, return_dict=False,
            add_generation_prompt=prompt, **extra))

    full = ids(len(messages), prompt=False)
    labels = [IGNORE_INDEX] * len(full)
    for turn, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        start = _prefix_length(ids(turn, prompt=True), full, sample, turn, "with")
        end = _prefix_length(ids(turn + 1, prompt=False), full, sample, turn + 1, "without")
        if end <= start:
            raise ValueError(
                f"{sample}: the chat template writes no token for assistant message {turn} "
                f"after its header (the first {turn} messages with the generation prompt end "
                f"at token {start}, the first {turn + 1} without it at token {end}): its "
                "generation prompt is not how it writes an assistant turn; fix the template")
        labels[start:end] = full[start:end]
    return _limited(full, labels, max_length, overflow, sample)


def check_chat_template(tokenizer: PreTrainedTokenizerBase) -> None:
    """Refuse a tokenizer that cannot render conversations.

    Raises:
        ValueError: if ``tokenizer.chat_template`` is not set, naming the tokenizer.
    """
    if not getattr(tokenizer, "chat_template", None):
        path = getattr(tokenizer, "name_or_path", "")
        origin = f"loaded from {path!r}" if path else "built in memory"
        raise ValueError(
            f"the tokenizer {type(tokenizer).__name__} ({origin}) has no chat template: set "
            "tokenizer.chat_template to the Jinja template of the chat format to train (a "
            "chat model's tokenizer_config.json or chat_template.jinja holds one), or load "
            "the tokenizer of the instruct/chat model")


def trained_tokens(labels: torch.Tensor) -> torch.Tensor:
    """The number of trained targets in ``labels`` (those not ``-100``), as a 0-dim int64
    tensor on ``labels``' device (no host sync): the ``num_items`` of
    ``backward(loss, num_items=...)`` for a loss summed over those targets.

    Count the targets the loss is computed on: when shifting yourself, ``labels[..., 1:]``.
    A rendered conversation's first label is always ``-100`` (it starts with a non-assistant
    message), so both counts agree for unpacked samples.
    """
    return (labels != IGNORE_INDEX).sum()


def pad_chat(samples: Sequence[Mapping[str, Sequence[int]]], *,
             pad_token_id: int) -> dict[str, torch.Tensor]:
    """A padded batch (a ``collate_fn``): ``input_ids`` padded with ``pad_token_id``,
    ``labels`` with ``-100``, and ``attention_mask`` (1 on real tokens), each
    ``[len(samples), longest]`` int64, padded on the right.

    Raises:
        ValueError: for no samples.
    """
    if not samples:
        raise ValueError("pad_chat needs at least one sample")
    longest = max(len(sample["input_ids"]) for sample in samples)
    shape = (len(samples), longest)
    batch = {"input_ids": torch.full(shape, pad_token_id, dtype=torch.long),
             "labels": torch.full(shape, IGNORE_INDEX, dtype=torch.long),
             "attention_mask": torch.zeros(shape, dtype=torch.long)}
    for row, sample in enumerate(samples):
        size = len(sample["input_ids"])
        batch["input_ids"][row, :size] = torch.as_tensor(sample["input_ids"])
        batch["labels"][row, :size] = torch.as_tensor(sample["labels"])
        batch["attention_mask"][row, :size] = 1
    return batch


class ChatDataset(Dataset[dict[str, list[int]]]):
    """Conversations from a JSONL file or an indexable source, rendered by ``render_chat``.

    Item ``i`` is ``{"input_ids": list[int], "labels": list[int]}``, rendered when read (not
    cached). ``lengths`` renders every conversation once, so that ``ShardedStream(dataset,
    sequence_length=..., lengths=dataset.lengths)`` packs without reading them again.

    Args:
        source: A JSONL file (one ``{messages_key: [...]}`` object per line; blank lines are
            skipped), or anything with ``len()`` and integer indexing whose items are
            mappings: a ``datasets.Dataset`` (local files), a list of dicts.
        tokenizer: A transformers tokenizer with a ``chat_template``.
        messages_key: The key of an item that holds its conversation.
        max_length: At most this many tokens per sample (None: no limit).
        overflow: Beyond ``max_length``: ``"truncate"`` or ``"error"``, as for
            ``render_chat``.
        template_kwargs: Extra variables for the template.

    Raises:
        ValueError: for a tokenizer without a chat template, an empty source, a
            ``max_length`` below 1 or an unknown ``overflow``. Reading a sample raises,
            naming it, for a JSONL line that is not a JSON object, an item without
            ``messages_key``, and ``render_chat``'s errors.
    """

    def __init__(self, source: str | os.PathLike[str] | Sequence[Mapping[str, Any]],
                 tokenizer: PreTrainedTokenizerBase, *, messages_key: str = "messages",
                 max_length: int | None = None, overflow: Overflow = "truncate",
                 template_kwargs: Mapping[str, Any] | None = None) -> None:
        check_chat_template(tokenizer)
        if max_length is not None and max_length < 1:
            raise ValueError(f"max_length={max_length} must be at least 1 (or None)")
        if overflow not in ("truncate", "error"):
            raise ValueError(f"overflow={overflow!r} must be 'truncate' or 'error'")
        self.tokenizer = tokenizer
        self.messages_key = messages_key
        self.max_length = max_length
        self.overflow: Overflow = overflow
        self.template_kwargs = dict(template_kwargs or {})
        self._records = Records(source, "conversations")
        self.path: Path | None = self._records.path
        self.source: Sequence[Mapping[str, Any]] | None = self._records.source
        if len(self) == 0:
            raise ValueError(f"{self._records.origin()} holds no conversation")
        self._lengths: list[int] | None = None

    def __len__(self) -> int:
        return len(self._records)

    def __getitem__(self, index: int) -> dict[str, list[int]]:
        index = self._records.checked(index)
        return render_chat(self.tokenizer, self.messages(index), max_length=self.max_length,
                           overflow=self.overflow, template_kwargs=self.template_kwargs,
                           sample=self.describe(index))

    @property
    def lengths(self) -> list[int]:
        """Every sample's token count, found once by rendering every conversation."""
        if self._lengths is None:
            self._lengths = [len(self[index]["input_ids"]) for index in range(len(self))]
        return self._lengths

    def messages(self, index: int) -> Sequence[Mapping[str, Any]]:
        """Sample ``index``'s conversation, as stored.

        Raises:
            ValueError: for an item that is not a mapping or has no ``messages_key``, or
                a JSONL line that is not valid JSON.
        """
        index = self._records.checked(index)
        item = self._records.get(index)
        if not isinstance(item, Mapping):
            raise ValueError(f"{self.describe(index)} is a {type(item).__name__}, not an "
                             f"object with a {self.messages_key!r} list")
        if self.messages_key not in item:
            raise ValueError(f"{self.describe(index)} has no {self.messages_key!r} key (its "
                             f"keys: {sorted(item)}): give messages_key= the key that holds "
                             "its conversation")
        return item[self.messages_key]

    def describe(self, index: int) -> str:
        """How errors name sample ``index``: ``"sample 3 (chats.jsonl line 4)"``."""
        return self._records.describe(index)


def _check_messages(messages: Any, sample: str) -> None:
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise ValueError(f"{sample}: the conversation is a {type(messages).__name__}, not a "
                         "list of {'role', 'content'} messages")
    if not messages:
        raise ValueError(f"{sample} is an empty conversation: give at least a user message "
                         "and an assistant reply, or leave the sample out")
    for turn, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise ValueError(f"{sample}: message {turn} is a {type(message).__name__}, not a "
                             "{'role', 'content'} mapping")
        for key in ("role", "content"):
            if message.get(key) is None:
                raise ValueError(f"{sample}: message {turn} has no {key!r}: every message "
                                 "needs a 'role' and a 'content'")
        if message["role"] not in ROLES:
            raise ValueError(f"{sample}: message {turn} has the unknown role "
                             f"{message['role']!r}: the roles are {', '.join(ROLES)}")
        if not isinstance(message["content"], str):
            raise ValueError(f"{sample}: message {turn}'s content is a "
                             f"{type(message['content']).__name__}: give a string (content "
                             "parts and tool calls without text are not supported)")
    if not any(message["role"] == "assistant" for message in messages):
        raise ValueError(f"{sample} has no assistant message: the loss is on assistant turns "
                         "only, so it would train nothing; add the reply or leave it out")
    if messages[0]["role"] == "assistant":
        raise ValueError(f"{sample} starts with an assistant message: where its header ends "
                         "is found from the messages before it; put a system or user "
                         "message first")


def _prefix_length(prefix: list[int], full: list[int], sample: str, count: int,
                   prompt: str) -> int:
    """``len(prefix)``, once ``prefix`` is checked to be a prefix of ``full``."""
    if prefix != full[:len(prefix)]:
        differ = next((i for i, (a, b) in enumerate(zip(prefix, full)) if a != b),
                      min(len(prefix), len(full)))
        raise ValueError(
            f"{sample}: the chat template renders the first {count} messages ({prompt} the "
            f"generation prompt) as {len(prefix)} tokens that are not a prefix of the whole "
            f"conversation's {len(full)} tokens (they differ at token {differ}), so the "
            "assistant turns cannot be located: the template writes a turn differently once "
            "later turns follow (or the tokenizer merges tokens across a turn boundary); "
            "use a template that renders each turn the same whatever follows it")
    return len(prefix)


def _limited(ids: list[int], labels: list[int], max_length: int | None, overflow: Overflow,
             sample: str) -> dict[str, list[int]]:
    if max_length is None or len(ids) <= max_length:
        return {"input_ids": ids, "labels": labels}
    if overflow == "error":
        raise ValueError(f"{sample} renders to {len(ids)} tokens, more than max_length="
                         f"{max_length}: raise max_length, set overflow='truncate', or leave "
                         "the conversation out")
    ids, labels = ids[:max_length], labels[:max_length]
    if all(label == IGNORE_INDEX for label in labels):
        raise ValueError(f"{sample} keeps no assistant token within max_length={max_length} "
                         "(its first assistant token is past it), so it would train "
                         "nothing: raise max_length, or leave the conversation out")
    return {"input_ids": ids, "labels": labels}
