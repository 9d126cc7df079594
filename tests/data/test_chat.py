"""Chat data: the loss is on assistant turns only, found from the template itself; bad
conversations are refused naming the sample; truncation is as stated."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from dream_trainer.data.chat import (IGNORE_INDEX, ChatDataset, pad_chat, render_chat,
                                     trained_tokens)

SPECIAL = ["<unk>", "<pad>", "<|im_start|>", "<|im_end|>"]
WORDS = ["system", "user", "assistant", "tool", "you", "are", "kind", "hi", "hello", "how",
         "is", "it", "fine", "thanks", "bye", "sunny", "rain", "weather", "today", "think"]
VOCAB = {token: index for index, token in enumerate(SPECIAL + WORDS)}
START, END = VOCAB["<|im_start|>"], VOCAB["<|im_end|>"]

# ChatML as Qwen2 and many others write it (the Whitespace pre-tokenizer drops the newlines).
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
# The same format with transformers' {% generation %} marks around the trained part.
CHATML_GENERATION = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['role'] == 'assistant' %}"
    "{% generation %}{{ m['content'] }}<|im_end|>\n{% endgeneration %}{% else %}"
    "{{ m['content'] }}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")

CONVERSATION = [
    {"role": "system", "content": "you are kind"},
    {"role": "user", "content": "hi"},
    {"role": "assistant", "content": "hello how is it"},
    {"role": "user", "content": "weather today"},
    {"role": "tool", "content": "sunny"},
    {"role": "assistant", "content": "sunny thanks"},
]


def make_tokenizer(template: str | None = CHATML) -> PreTrainedTokenizerFast:
    backend = Tokenizer(models.WordLevel(VOCAB, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>",
                                        pad_token="<pad>",
                                        additional_special_tokens=["<|im_start|>", "<|im_end|>"])
    tokenizer.chat_template = template
    return tokenizer


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerFast:
    return make_tokenizer()


def turn(role: str, content: str) -> list[int]:
    return [START, VOCAB[role], *(VOCAB[word] for word in content.split()), END]


def trained_values(sample: dict[str, list[int]]) -> list[int]:
    return [label for label in sample["labels"] if label != IGNORE_INDEX]


def test_labels_are_the_ids_exactly_on_assistant_content_and_end_of_turn(tokenizer) -> None:
    sample = render_chat(tokenizer, CONVERSATION)
    expected = [id for message in CONVERSATION for id in turn(message["role"],
                                                              message["content"])]
    assert sample["input_ids"] == expected
    # system 0-5, user 6-9, assistant header 10-11, content 12-15, <|im_end|> 16, user 17-21,
    # tool 22-25, assistant header 26-27, content 28-29, <|im_end|> 30.
    trained = [12, 13, 14, 15, 16, 28, 29, 30]
    assert [i for i, label in enumerate(sample["labels"]) if label != IGNORE_INDEX] == trained
    assert all(sample["labels"][i] == sample["input_ids"][i] for i in trained)
    assert [sample["input_ids"][i] for i in (16, 30)] == [END, END]
    assert [sample["input_ids"][i] for i in (10, 11, 26, 27)] == [START, VOCAB["assistant"]] * 2


def test_the_spans_equal_transformers_generation_mask(tokenizer) -> None:
    marked = make_tokenizer(CHATML_GENERATION)
    reference = marked.apply_chat_template(CONVERSATION, return_dict=True,
                                           return_assistant_tokens_mask=True)
    ours = render_chat(tokenizer, CONVERSATION)
    assert reference["input_ids"] == ours["input_ids"]
    assert reference["assistant_masks"] == [int(label != IGNORE_INDEX)
                                            for label in ours["labels"]]


def test_user_and_system_tokens_change_no_trained_label(tokenizer) -> None:
    base = render_chat(tokenizer, CONVERSATION)
    for index, content in ((0, "you are fine"), (1, "bye bye bye"), (3, "rain"),
                           (4, "rain today")):
        changed = [dict(message) for message in CONVERSATION]
        changed[index]["content"] = content
        sample = render_chat(tokenizer, changed)
        assert sample["input_ids"] != base["input_ids"]
        assert trained_values(sample) == trained_values(base), index
    changed = [dict(message) for message in CONVERSATION]
    changed[2]["content"] = "hello how is rain"
    sample = render_chat(tokenizer, changed)
    assert trained_values(sample) != trained_values(base)
    assert trained_values(sample)[3] == VOCAB["rain"]


def test_trained_tokens_is_the_count_that_makes_the_summed_loss_the_mean(tokenizer) -> None:
    samples = [render_chat(tokenizer, CONVERSATION), render_chat(tokenizer, CONVERSATION[:3])]
    batch = pad_chat(samples, pad_token_id=VOCAB["<pad>"])
    count = trained_tokens(batch["labels"])
    assert count.dim() == 0 and count.dtype == torch.int64 and int(count) == 8 + 5
    assert int(trained_tokens(batch["labels"][:, 1:])) == 13  # first labels are -100
    logits = torch.randn(*batch["labels"].shape, len(VOCAB), generator=torch.Generator()
                         .manual_seed(0))
    flat_logits, flat_labels = logits.flatten(0, 1), batch["labels"].flatten()
    summed = F.cross_entropy(flat_logits, flat_labels, reduction="sum")
    mean = F.cross_entropy(flat_logits, flat_labels)
    # One sum divided by the count against torch's own mean: another order of summation of
    # 13 terms of size ~3, so a few float32 ulps of the result.
    torch.testing.assert_close(summed / count, mean, rtol=4 * 2**-23, atol=0)


def test_pad_chat_pads_ids_labels_and_mask_on_the_right(tokenizer) -> None:
    long, short = render_chat(tokenizer, CONVERSATION), render_chat(tokenizer, CONVERSATION[:3])
    batch = pad_chat([short, long], pad_token_id=VOCAB["<pad>"])
    size = len(short["input_ids"])
    assert batch["input_ids"].shape == (2, 31) and size == 17
    assert batch["input_ids"][0].tolist() == short["input_ids"] + [VOCAB["<pad>"]] * 14
    assert batch["labels"][0].tolist() == short["labels"] + [IGNORE_INDEX] * 14
    assert batch["attention_mask"][0].tolist() == [1] * 17 + [0] * 14
    assert batch["labels"][1].tolist() == long["labels"]
    assert batch["attention_mask"][1].tolist() == [1] * 31
    with pytest.raises(ValueError, match="^pad_chat needs at least one sample$"):
        pad_chat([], pad_token_id=0)


def test_truncation_drops_the_end_and_refuses_a_sample_left_without_assistant_tokens(
        tokenizer) -> None:
    whole = render_chat(tokenizer, CONVERSATION)
    for limit in (31, 32):  # at and over the length: unchanged
        assert render_chat(tokenizer, CONVERSATION, max_length=limit) == whole
    cut = render_chat(tokenizer, CONVERSATION, max_length=14)
    assert cut == {"input_ids": whole["input_ids"][:14], "labels": whole["labels"][:14]}
    assert trained_values(cut) == [VOCAB["hello"], VOCAB["how"]]
    assert render_chat(tokenizer, CONVERSATION, max_length=13)["labels"][12] == VOCAB["hello"]
    with pytest.raises(ValueError) as refused:
        render_chat(tokenizer, CONVERSATION, max_length=12, sample="sample 7")
    assert str(refused.value) == (
        "sample 7 keeps no assistant token within max_length=12 (its first assistant token "
        "is past it), so it would train nothing: raise max_length, or leave the "
        "conversation out")
    with pytest.raises(ValueError) as over:
        render_chat(tokenizer, CONVERSATION, max_length=30, overflow="error", sample="sample 7")
    assert str(over.value) == (
        "sample 7 renders to 31 tokens, more than max_length=30: raise max_length, set "
        "overflow='truncate', or leave the conversation out")
    assert render_chat(tokenizer, CONVERSATION, max_length=31, overflow="error") == whole


BAD = [
    ([], "sample 1 (PATH line 3) is an empty conversation: give at least a user message and "
         "an assistant reply, or leave the sample out"),
    ([{"role": "user", "content": "hi"}],
     "sample 1 (PATH line 3) has no assistant message: the loss is on assistant turns only, "
     "so it would train nothing; add the reply or leave it out"),
    ([{"role": "user", "content": "hi"}, {"role": "bot", "content": "hello"}],
     "sample 1 (PATH line 3): message 1 has the unknown role 'bot': the roles are system, "
     "user, assistant, tool"),
    ([{"content": "hi"}, {"role": "assistant", "content": "hello"}],
     "sample 1 (PATH line 3): message 0 has no 'role': every message needs a 'role' and a "
     "'content'"),
    ([{"role": "user", "content": "hi"}, {"role": "assistant"}],
     "sample 1 (PATH line 3): message 1 has no 'content': every message needs a 'role' and "
     "a 'content'"),
    ([{"role": "user", "content": "hi"}, "hello"],
     "sample 1 (PATH line 3): message 1 is a str, not a {'role', 'content'} mapping"),
    ([{"role": "user", "content": ["hi"]}, {"role": "assistant", "content": "hello"}],
     "sample 1 (PATH line 3): message 0's content is a list: give a string (content parts "
     "and tool calls without text are not supported)"),
    ([{"role": "assistant", "content": "hello"}, {"role": "user", "content": "hi"}],
     "sample 1 (PATH line 3) starts with an assistant message: where its header ends is "
     "found from the messages before it; put a system or user message first"),
    ("hi", "sample 1 (PATH line 3): the conversation is a str, not a list of {'role', "
           "'content'} messages"),
]


@pytest.mark.parametrize("messages,message", BAD, ids=range(len(BAD)))
def test_a_bad_conversation_is_refused_naming_the_sample_and_its_line(
        tokenizer, tmp_path: Path, messages: Any, message: str) -> None:
    path = tmp_path / "chats.jsonl"
    good = {"messages": CONVERSATION[1:3]}
    # Line 2 is blank: sample 1 is on line 3.
    path.write_text(json.dumps(good) + "\n\n" + json.dumps({"messages": messages}) + "\n")
    dataset = ChatDataset(path, tokenizer)
    assert len(dataset) == 2 and dataset[0] == render_chat(tokenizer, CONVERSATION[1:3])
    with pytest.raises(ValueError) as refused:
        dataset[1]
    assert str(refused.value) == message.replace("PATH", str(path))


def test_a_tokenizer_without_a_chat_template_is_refused() -> None:
    bare = make_tokenizer(None)
    expected = (f"the tokenizer {type(bare).__name__} (built in memory) has no chat "
                "template: set tokenizer.chat_template to the Jinja template of the chat "
                "format to train (a chat model's tokenizer_config.json or chat_template.jinja "
                "holds one), or load the tokenizer of the instruct/chat model")
    with pytest.raises(ValueError) as refused:
        render_chat(bare, CONVERSATION)
    assert str(refused.value) == expected
    with pytest.raises(ValueError) as refused:
        ChatDataset([{"messages": CONVERSATION}], bare)
    assert str(refused.value) == expected
    bare.name_or_path = "models/base"
    with pytest.raises(ValueError, match=f"^the tokenizer {type(bare).__name__} \\(loaded "
                                         "from 'models/base'\\) has no chat template: "):
        render_chat(bare, CONVERSATION)


def test_a_template_that_writes_a_turn_differently_once_others_follow_is_refused() -> None:
    # Marks the final message (as templates that strip earlier reasoning do): the render of
    # the first k messages is then not a prefix of the whole conversation's.
    last = make_tokenizer(CHATML.replace("<|im_end|>", "{% if loop.last %} think{% endif %}"
                                                       "<|im_end|>"))
    with pytest.raises(ValueError) as refused:
        render_chat(last, CONVERSATION[:3], sample="sample 0")
    assert str(refused.value) == (
        "sample 0: the chat template renders the first 2 messages (with the generation "
        "prompt) as 13 tokens that are not a prefix of the whole conversation's 18 tokens "
        "(they differ at token 9), so the assistant turns cannot be located: the template "
        "writes a turn differently once later turns follow (or the tokenizer merges tokens "
        "across a turn boundary); use a template that renders each turn the same whatever "
        "follows it")
    # A generation prompt that is not how the template writes an assistant turn.
    prompt = make_tokenizer(CHATML.replace("<|im_start|>assistant\n{% endif %}",
                                           "<|im_start|>assistant\nthink\n{% endif %}"))
    with pytest.raises(ValueError, match=r"^sample 0: the chat template renders the first 2 "
                                         r"messages \(with the generation prompt\) as 13 "):
        render_chat(prompt, CONVERSATION[:3], sample="sample 0")


def write_jsonl(path: Path, conversations: list[list[dict[str, str]]], key: str) -> None:
    path.write_text("".join(json.dumps({key: messages, "id": index}) + "\n"
                            for index, messages in enumerate(conversations)))


def test_jsonl_and_datasets_sources_give_the_same_samples(tokenizer, tmp_path: Path) -> None:
    import datasets

    conversations = [CONVERSATION, CONVERSATION[:3], CONVERSATION[1:3] + CONVERSATION[3:]]
    path = tmp_path / "chats.jsonl"
    write_jsonl(path, conversations, key="chat")
    from_file = ChatDataset(path, tokenizer, messages_key="chat")
    loaded = datasets.load_dataset("json", data_files=str(path), split="train",
                                   cache_dir=str(tmp_path / "cache"))
    from_arrow = ChatDataset(loaded, tokenizer, messages_key="chat")
    expected = [render_chat(tokenizer, messages) for messages in conversations]
    assert [from_file[i] for i in range(3)] == [from_arrow[i] for i in range(3)] == expected
    assert from_file[-1] == expected[2]
    assert from_file.lengths == from_arrow.lengths == [31, 17, 25]
    assert from_file.describe(2) == f"sample 2 ({path} line 3)"
    with pytest.raises(IndexError, match="^sample 3 is out of range for 3 conversations$"):
        from_file[3]
    loader = torch.utils.data.DataLoader(from_file, batch_size=2, collate_fn=lambda samples:
                                         pad_chat(samples, pad_token_id=0))
    assert [batch["labels"].shape for batch in loader] == [(2, 31), (1, 25)]


def test_a_sharded_stream_packs_the_rendered_samples(tokenizer) -> None:
    from dream_trainer.data import ShardedStream

    dataset = ChatDataset([{"messages": CONVERSATION}, {"messages": CONVERSATION[:3]}],
                          tokenizer)
    stream = ShardedStream(dataset, shuffle=False, sequence_length=23, lengths=dataset.lengths)
    ids = dataset[0]["input_ids"] + dataset[1]["input_ids"]
    assert [stream.sample(g).tolist() for g in range(2)] == [ids[:23], ids[23:46]]


def test_bad_files_keys_and_options_are_refused(tokenizer, tmp_path: Path) -> None:
    path = tmp_path / "chats.jsonl"
    path.write_text('{"messages": []\n[1]\n{"text": "hi"}\n')
    dataset = ChatDataset(path, tokenizer)
    with pytest.raises(ValueError, match=rf"^sample 0 \({path} line 1\) is not valid JSON: "):
        dataset[0]
    with pytest.raises(ValueError) as refused:
        dataset[1]
    assert str(refused.value) == (f"sample 1 ({path} line 2) is a list, not an object with "
                                  "a 'messages' list")
    with pytest.raises(ValueError) as refused:
        dataset[2]
    assert str(refused.value) == (f"sample 2 ({path} line 3) has no 'messages' key (its "
                                  "keys: ['text']): give messages_key= the key that holds "
                                  "its conversation")
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(ValueError, match=rf"^{empty} holds no conversation$"):
        ChatDataset(empty, tokenizer)
    with pytest.raises(ValueError, match=r"^the list holds no conversation$"):
        ChatDataset([], tokenizer)
    with pytest.raises(ValueError, match=r"^max_length=0 must be at least 1 \(or None\)$"):
        ChatDataset(path, tokenizer, max_length=0)
    with pytest.raises(ValueError, match=r"^overflow='drop' must be 'truncate' or 'error'$"):
        ChatDataset(path, tokenizer, overflow="drop")  # type: ignore[arg-type]
