"""Preference pairs (a prompt, a chosen and a rejected answer) as token ids with the loss on the
answers only, and the batch layout that serves both answers with one forward pass.

A sample is plain text (three strings) or a conversation (three lists of messages: the prompt's
turns, then each answer's, starting with an assistant message). Conversations are rendered
with the tokenizer's chat template by ``render_chat``, so an answer's labels are exactly what
supervised fine-tuning trains (assistant content and its end-of-turn tokens); the prompt's own
assistant turns, if any, are context and get ``-100`` here.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch.utils.data import Dataset

from dream_trainer.data.chat import IGNORE_INDEX, check_chat_template, pad_chat, render_chat
from dream_trainer.data.jsonl import Records

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

ANSWERS = ("chosen", "rejected")


def pad_preferences(samples: Sequence[Mapping[str, Sequence[int]]], *,
                    pad_token_id: int) -> dict[str, torch.Tensor]:
    """A padded batch of ``2 * len(samples)`` rows (a ``collate_fn``): every sample's chosen
    answer, then every sample's rejected answer, as ``input_ids`` (padded with
    ``pad_token_id``), ``labels`` (padded with -100) and ``attention_mask`` (1 on real
    tokens), each ``[2 * len(samples), longest]`` int64, padded on the right.

    Raises:
        ValueError: for no samples.
    """
    if not samples:
        raise ValueError("pad_preferences needs at least one sample")
    return pad_chat([{"input_ids": sample[f"{answer}_input_ids"],
                      "labels": sample[f"{answer}_labels"]}
                     for answer in ANSWERS for sample in samples], pad_token_id=pad_token_id)


class PreferenceDataset(Dataset[dict[str, list[int]]]):
    """Preference triples from a JSONL file or an indexable source, tokenized when read.

    Item ``i`` is ``{"chosen_input_ids", "chosen_labels", "rejected_input_ids",
    "rejected_labels"}`` (lists of ints): the prompt's tokens then the answer's, the labels
    -100 on the prompt and equal to the ids on the answer (``labels[i]`` is the target of
    ``input_ids[i]``, transformers' convention). Text prompts are tokenized with the tokenizer's
    special tokens (a BOS where it adds one), text answers without, followed by its EOS; the two
    are tokenized separately, so write the space or newline between them yourself.
    Truncation: the prompt is never cut; an answer longer than ``max_length`` allows is cut
    from its end.

    Args:
        source: A JSONL file (one object per line; blank lines are skipped), or anything with
            ``len()`` and integer indexing whose items are mappings: a ``datasets.Dataset``
            (local files), a list of dicts.
        tokenizer: A transformers tokenizer (with a ``chat_template`` for conversations).
        max_length: At most this many tokens per answer's sequence, prompt included (None: no
            limit).
        prompt_key: The key of an item's prompt.
        chosen_key: The key of an item's chosen answer.
        rejected_key: The key of an item's rejected answer.
        template_kwargs: Extra variables for the chat template.
        pad_token_id: The id ``collate`` pads with (None: the tokenizer's pad token). Padding
            is masked out of attention and labels, so any id works.

    Raises:
        ValueError: for an empty source, a ``max_length`` below 2, or no ``pad_token_id``
            with a tokenizer that has no pad token. Reading a sample raises, naming it, for a
            line that is not a JSON object, an item without one of the keys, parts that are
            not all strings or all message lists, an empty answer, chosen and rejected answers
            that are identical (or become so when cut to ``max_length``), a prompt that leaves
            no room for an answer within ``max_length``, and ``render_chat``'s errors.
    """

    def __init__(self, source: str | os.PathLike[str] | Sequence[Mapping[str, Any]],
                 tokenizer: PreTrainedTokenizerBase, *, max_length: int | None = None,
                 prompt_key: str = "prompt", chosen_key: str = "chosen",
                 rejected_key: str = "rejected", template_kwargs: Mapping[str, Any] | None = None,
                 pad_token_id: int | None = None) -> None:
        if max_length is not None and max_length < 2:
            raise ValueError(f"max_length={max_length} must be at least 2 (a prompt token and "
                             "an answer token) or None")
        pad_token_id = tokenizer.pad_token_id if pad_token_id is None else pad_token_id
        if pad_token_id is None:
            raise ValueError(f"the tokenizer {type(tokenizer).__name__} has no pad token: pass "
                             "pad_token_id= (any id works, padding is masked out; "
                             "tokenizer.eos_token_id is the usual choice) or set "
                             "tokenizer.pad_token")
        self.tokenizer = tokenizer
        self.max_length = max_length
        self.keys = {"prompt": prompt_key, "chosen": chosen_key, "rejected": rejected_key}
        self.template_kwargs = dict(template_kwargs or {})
        self.pad_token_id = int(pad_token_id)
        self._records = Records(source, "preference triples")
        self.path: Path | None = self._records.path
        self.source: Sequence[Mapping[str, Any]] | None = self._records.source
        if len(self) == 0:
            raise ValueError(f"{self._records.origin()} holds no preference triple")

    def __len__(self) -> int:
        return len(self._records)

    def __getitem__(self, index: int) -> dict[str, list[int]]:
        index = self._records.checked(index)
        sample = self.describe(index)
        prompt, chosen, rejected = self.triple(index)
        if isinstance(prompt, str):
            length, answers, labelled = self._text(prompt, chosen, rejected)
        else:
            length, answers, labelled = self._conversations(prompt, chosen, rejected,
                                                            sample=sample)
        if length == 0:
            raise ValueError(f"{sample}: the prompt is no token, so the answer's first token "
                             "could not be scored (a label at position 0 has no logits before "
                             "it): give the prompt text, or use a tokenizer that adds a BOS")
        if answers[0] == answers[1]:
            raise ValueError(f"{sample}: the chosen and rejected answers are identical "
                             f"({len(answers[0]) - length} tokens after the prompt), so the "
                             "pair states no preference and trains nothing: fix the pair or "
                             "leave it out of the data")
        if self.max_length is not None:
            answers, labelled = _truncated(answers, labelled, length, self.max_length, sample)
        return {"chosen_input_ids": answers[0], "chosen_labels": labelled[0],
                "rejected_input_ids": answers[1], "rejected_labels": labelled[1]}

    def collate(self, samples: Sequence[Mapping[str, Sequence[int]]]) -> dict[str, torch.Tensor]:
        """``pad_preferences`` with this dataset's ``pad_token_id``: the ``collate_fn`` of its
        loader."""
        return pad_preferences(samples, pad_token_id=self.pad_token_id)

    def triple(self, index: int) -> tuple[Any, Any, Any]:
        """Sample ``index``'s prompt, chosen and rejected answers, as stored, once checked to
        be three strings or three message lists with non-empty answers.

        Raises:
            ValueError: naming the sample, for a line that is not a JSON object, a missing
                key, parts of other types or mixed kinds, an empty answer, an answer
                conversation that does not start with an assistant message, a prompt
                conversation that is empty or ends with one.
        """
        index = self._records.checked(index)
        sample = self.describe(index)
        item = self._records.get(index)
        if not isinstance(item, Mapping):
            raise ValueError(f"{sample} is a {type(item).__name__}, not an object with "
                             f"{', '.join(repr(key) for key in self.keys.values())} keys")
        missing = [key for key in self.keys.values() if key not in item]
        if missing:
            raise ValueError(f"{sample} has no {', '.join(map(repr, missing))} key (its keys: "
                             f"{sorted(item)}): give prompt_key=, chosen_key=, rejected_key= "
                             "the keys that hold the prompt and the two answers")
        parts = {part: item[key] for part, key in self.keys.items()}
        if all(isinstance(value, str) for value in parts.values()):
            for name in ANSWERS:
                if not parts[name].strip():
                    raise ValueError(f"{sample}: the {name} answer is empty, so it has nothing "
                                     "to score: give it text, or leave the pair out of the data")
        elif all(_is_message_list(value) for value in parts.values()):
            _check_conversations(parts, sample)
        else:
            kinds = ", ".join(f"{part} is {_kind(value)}" for part, value in parts.items())
            raise ValueError(f"{sample}: {kinds}: give three strings (plain text) or three "
                             "lists of {'role', 'content'} messages (a conversation)")
        return parts["prompt"], parts["chosen"], parts["rejected"]

    def describe(self, index: int) -> str:
        """How errors name sample ``index``: ``"sample 3 (pairs.jsonl line 4)"``."""
        return self._records.describe(index)

    def _text(self, prompt: str, *answers: str) -> tuple[int, list[list[int]], list[list[int]]]:
        """The prompt's length, and each answer's ids and labels, for text."""
        prompt_ids = list(self.tokenizer(prompt)["input_ids"])
        eos = self.tokenizer.eos_token_id
        sequences, labelled = [], []
        for answer in answers:
            answer_ids = list(self.tokenizer(answer, add_special_tokens=False)["input_ids"])
            # The EOS teaches the policy to stop; TRL appends it to text answers too.
            if eos is not None and answer_ids[-1:] != [eos]:
                answer_ids.append(eos)
            sequences.append(prompt_ids + answer_ids)
            labelled.append([IGNORE_INDEX] * len(prompt_ids) + answer_ids)
        return len(prompt_ids), sequences, labelled

    def _conversations(self, prompt: Sequence[Mapping[str, Any]],
                       *answers: Sequence[Mapping[str, Any]], sample: str
                       ) -> tuple[int, list[list[int]], list[list[int]]]:
        """The prompt's length, and each answer's ids and labels, for conversations."""
        check_chat_template(self.tokenizer)
        length = len(self.tokenizer.apply_chat_template(
            list(prompt), tokenize=True, return_dict=False, add_generation_prompt=True,
            **self.template_kwargs))
        rendered = [render_chat(self.tokenizer, [*prompt, *answer],
                                template_kwargs=self.template_kwargs,
                                sample=f"{sample} (prompt + {name} answer)")
                    for name, answer in zip(ANSWERS, answers)]
        # render_chat checked that the prompt with the generation prompt renders as a prefix
        # of each conversation (its next message, the answer's first, is the assistant's),
        # so the answer starts at the same token in both; the prompt's own assistant turns,
        # which render_chat labels, are context here.
        return (length, [render["input_ids"] for render in rendered],
                [[IGNORE_INDEX] * length + render["labels"][length:] for render in rendered])

def _is_message_list(value: Any) -> bool:
    return isinstance(value, Sequence) and not isinstance(value, (str, bytes))


def _kind(value: Any) -> str:
    if isinstance(value, str):
        return "a string"
    if _is_message_list(value):
        return "a message list"
    return f"a {type(value).__name__}"


def _check_conversations(parts: Mapping[str, Sequence[Any]], sample: str) -> None:
    """What ``render_chat`` cannot see in the joined conversation: where the prompt ends."""
    prompt = parts["prompt"]
    if not prompt:
        raise ValueError(f"{sample}: the prompt is an empty conversation: give at least a "
                         "user message")
    if isinstance(prompt[-1], Mapping) and prompt[-1].get("role") == "assistant":
        raise ValueError(f"{sample}: the prompt ends with an assistant message: the answers "
                         "are the assistant's next turn, so end the prompt with a user (or "
                         "tool) message and put the assistant's reply in the answers")
    for name in ANSWERS:
        answer = parts[name]
        if not answer:
            raise ValueError(f"{sample}: the {name} answer is an empty conversation, so it "
                             "has nothing to score: give its assistant message, or leave the "
                             "pair out of the data")
        first = answer[0]
        if not isinstance(first, Mapping) or first.get("role") != "assistant":
            role = first.get("role") if isinstance(first, Mapping) else type(first).__name__
            raise ValueError(f"{sample}: the {name} answer starts with {role!r}, not an "
                             "assistant message: an answer is the assistant's reply to the "
                             "prompt (move earlier turns into the prompt)")
        contents = [message.get("content") for message in answer
                    if isinstance(message, Mapping) and message.get("role") == "assistant"]
        if all(isinstance(content, str) and not content.strip() for content in contents):
            raise ValueError(f"{sample}: the {name} answer is empty (its assistant messages "
                             "have no text), so it has nothing to score: give it text, or "
                             "leave the pair out of the data")


def _truncated(answers: list[list[int]], labelled: list[list[int]], prompt: int,
               max_length: int, sample: str) -> tuple[list[list[int]], list[list[int]]]:
    """The answers cut to ``max_length`` tokens from their end; the prompt is never cut."""
    if prompt >= max_length:
        raise ValueError(f"{sample}: its prompt is {prompt} tokens, so max_length={max_length} "
                         "leaves no room for an answer (prompts are never cut): raise "
                         f"max_length above {prompt}, shorten the prompt, or leave the pair out "
                         "of the data")
    answers = [ids[:max_length] for ids in answers]
    if answers[0] == answers[1]:
        raise ValueError(f"{sample}: the chosen and rejected answers differ only after "
                         f"max_length={max_length} (their first {max_length - prompt} tokens "
                         "are identical), so the cut pair would train nothing: raise "
                         "max_length, or leave the pair out of the data")
    return answers, [labels[:max_length] for labels in labelled]
