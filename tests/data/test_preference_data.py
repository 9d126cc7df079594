"""Preference data: triples of plain text or conversations tokenized with the loss on the
answers only, the [chosen; rejected] batch layout, the truncation rule, TRL's tokenization of
the same triples, and bad triples refused naming the sample and the fix."""

from __future__ import annotations

import json
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from torch.utils.data import DataLoader
from transformers import PreTrainedTokenizerFast

from dream_trainer.data import PreferenceDataset
from dream_trainer.data.preference import pad_preferences

SPECIAL = ["<unk>", "<pad>", "<|im_start|>", "<|im_end|>"]
WORDS = ["system", "user", "assistant", "tool", "be", "kind", "hi", "hello", "how", "are", "you",
         "fine", "thanks", "bad", "go", "away", "sunny", "rain", "weather", "today"]
VOCAB = {token: index for index, token in enumerate(SPECIAL + WORDS)}
PAD, START, END = VOCAB["<pad>"], VOCAB["<|im_start|>"], VOCAB["<|im_end|>"]
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
X = -100


def make_tokenizer(pad: bool = True) -> PreTrainedTokenizerFast:
    """A word-level tokenizer of WORDS with ChatML, its EOS the end of turn (as Qwen's)."""
    backend = Tokenizer(models.WordLevel(VOCAB, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>",
                                        pad_token="<pad>" if pad else None,
                                        eos_token="<|im_end|>",
                                        additional_special_tokens=["<|im_start|>",
                                                                   "<|im_end|>"])
    tokenizer.chat_template = CHATML
    return tokenizer


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerFast:
    return make_tokenizer()


def ids(text: str) -> list[int]:
    return [VOCAB[word] for word in text.split()]


def turn(role: str, content: str) -> list[int]:
    return [START, VOCAB[role], *ids(content), END]


def user(content: str) -> dict[str, str]:
    return {"role": "user", "content": content}


def assistant(content: str) -> dict[str, str]:
    return {"role": "assistant", "content": content}


TEXT = {"prompt": "how are you", "chosen": " fine thanks", "rejected": " bad"}
CHAT = {"prompt": [{"role": "system", "content": "be kind"}, user("hi")],
        "chosen": [assistant("hello how are you")], "rejected": [assistant("go away")]}


def test_text_triple_labels_the_answer_and_its_eos_only(tokenizer) -> None:
    item = PreferenceDataset([TEXT], tokenizer)[0]
    prompt = ids("how are you")
    assert item == {
        "chosen_input_ids": prompt + ids("fine thanks") + [END],
        "chosen_labels": [X, X, X] + ids("fine thanks") + [END],
        "rejected_input_ids": prompt + ids("bad") + [END],
        "rejected_labels": [X, X, X] + ids("bad") + [END]}
    # An answer that already ends with the EOS gets no second one.
    item = PreferenceDataset([{**TEXT, "rejected": "bad <|im_end|>"}], tokenizer)[0]
    assert item["rejected_input_ids"] == prompt + ids("bad") + [END]


def test_conversation_triple_labels_the_assistant_reply_only(tokenizer) -> None:
    item = PreferenceDataset([CHAT], tokenizer)[0]
    prompt = turn("system", "be kind") + turn("user", "hi") + [START, VOCAB["assistant"]]
    assert item["chosen_input_ids"] == prompt + ids("hello how are you") + [END]
    assert item["chosen_labels"] == [X] * len(prompt) + ids("hello how are you") + [END]
    assert item["rejected_input_ids"] == prompt + ids("go away") + [END]
    assert item["rejected_labels"] == [X] * len(prompt) + ids("go away") + [END]

    # The prompt's own assistant turns are context: not trained, unlike in ChatDataset. A
    # multi-message answer trains its assistant turns, not the tool's.
    multi = {"prompt": [user("hi"), assistant("hello"), user("weather today")],
             "chosen": [assistant("sunny"), {"role": "tool", "content": "rain"},
                        assistant("rain")],
             "rejected": [assistant("bad")]}
    item = PreferenceDataset([multi], tokenizer)[0]
    prompt = (turn("user", "hi") + turn("assistant", "hello") + turn("user", "weather today")
              + [START, VOCAB["assistant"]])
    assert item["chosen_input_ids"] == (prompt + ids("sunny") + [END] + turn("tool", "rain")
                                        + turn("assistant", "rain"))
    assert item["chosen_labels"] == ([X] * len(prompt) + ids("sunny") + [END] + [X] * 4
                                     + [X, X] + ids("rain") + [END])
    assert item["rejected_labels"] == [X] * len(prompt) + ids("bad") + [END]


def test_sources_jsonl_list_and_datasets_give_the_same_items(tokenizer, tmp_path) -> None:
    from datasets import Dataset

    triples = [TEXT, CHAT, {"prompt": "hi", "chosen": " hello", "rejected": " go away"}]
    path = tmp_path / "pairs.jsonl"
    path.write_text("\n".join(json.dumps(triple) for triple in triples) + "\n\n")
    expected = [PreferenceDataset(triples, tokenizer)[i] for i in range(3)]
    from_file = PreferenceDataset(path, tokenizer)
    assert len(from_file) == 3 and [from_file[i] for i in range(3)] == expected
    assert from_file[-1] == expected[2]
    # datasets stores a column of one type: the text triples and the conversation apart.
    text = PreferenceDataset(Dataset.from_list([triples[0], triples[2]]), tokenizer)
    assert [text[0], text[1]] == [expected[0], expected[2]]
    assert PreferenceDataset(Dataset.from_list([CHAT]), tokenizer)[0] == expected[1]
    # Other keys.
    renamed = [{"question": TEXT["prompt"], "good": TEXT["chosen"], "bad": TEXT["rejected"]}]
    assert PreferenceDataset(renamed, tokenizer, prompt_key="question", chosen_key="good",
                             rejected_key="bad")[0] == expected[0]


def test_collate_puts_every_chosen_row_before_every_rejected_row(tokenizer) -> None:
    dataset = PreferenceDataset([TEXT, CHAT], tokenizer)
    first, second = dataset[0], dataset[1]
    batch = dataset.collate([first, second])
    rows = [first["chosen_input_ids"], second["chosen_input_ids"],
            first["rejected_input_ids"], second["rejected_input_ids"]]
    labels = [first["chosen_labels"], second["chosen_labels"], first["rejected_labels"],
              second["rejected_labels"]]
    longest = max(map(len, rows))
    assert longest == 16
    assert batch["input_ids"].tolist() == [row + [PAD] * (longest - len(row)) for row in rows]
    assert batch["labels"].tolist() == [row + [X] * (longest - len(row)) for row in labels]
    assert batch["attention_mask"].tolist() == [[1] * len(row) + [0] * (longest - len(row))
                                                for row in rows]
    assert all(tensor.dtype == torch.int64 for tensor in batch.values())
    # pad_preferences with another pad id; the loader's batch of 2 pairs has 4 rows.
    assert pad_preferences([first, second], pad_token_id=0)["input_ids"][2].tolist() == (
        rows[2] + [0] * (longest - len(rows[2])))
    loader = DataLoader(dataset, batch_size=2, collate_fn=dataset.collate)
    assert torch.equal(next(iter(loader))["input_ids"], batch["input_ids"])
    with pytest.raises(ValueError, match="^pad_preferences needs at least one sample$"):
        dataset.collate([])


def test_answers_are_cut_from_their_end_and_the_prompt_never(tokenizer) -> None:
    triple = {"prompt": "how are you", "chosen": " fine thanks", "rejected": " fine bad"}
    item = PreferenceDataset([triple], tokenizer, max_length=5)[0]
    assert item == {"chosen_input_ids": ids("how are you fine thanks"),
                    "chosen_labels": [X, X, X] + ids("fine thanks"),
                    "rejected_input_ids": ids("how are you fine bad"),
                    "rejected_labels": [X, X, X] + ids("fine bad")}
    # A sequence within max_length is untouched (the EOS kept).
    assert PreferenceDataset([triple], tokenizer, max_length=6)[0]["chosen_input_ids"] == (
        ids("how are you fine thanks") + [END])
    # Conversations likewise: the answer loses its end-of-turn and then its last words.
    item = PreferenceDataset([CHAT], tokenizer, max_length=13)[0]
    assert item["chosen_input_ids"] == (turn("system", "be kind") + turn("user", "hi")
                                        + [START, VOCAB["assistant"]] + ids("hello how"))
    assert item["chosen_labels"][-3:] == [X] + ids("hello how")


def refused(call: Callable[[], Any]) -> str:
    with pytest.raises(ValueError) as error:
        call()
    return str(error.value)


def test_the_three_bad_triples_are_refused_naming_the_sample(tokenizer, tmp_path) -> None:
    triples = [TEXT,
               {"prompt": "hi", "chosen": " hello", "rejected": " hello"},
               {"prompt": "hi", "chosen": " hello", "rejected": "  "},
               {"prompt": "how are you today", "chosen": " fine", "rejected": " bad"},
               {"prompt": [user("hi")], "chosen": [assistant("go")], "rejected": [assistant("go")]},
               {"prompt": [user("hi")], "chosen": [assistant("")], "rejected": [assistant("go")]},
               {"prompt": [user("hi")], "chosen": [], "rejected": [assistant("go")]},
               {"prompt": "hi", "chosen": " fine thanks you", "rejected": " fine thanks you bad"}]
    path = tmp_path / "pairs.jsonl"
    path.write_text("\n\n".join(json.dumps(triple) for triple in triples) + "\n")
    dataset = PreferenceDataset(path, tokenizer, max_length=4)

    def message(index: int) -> str:
        return refused(lambda: dataset[index]).replace(str(path), "pairs.jsonl")

    assert message(1) == (
        "sample 1 (pairs.jsonl line 3): the chosen and rejected answers are identical (2 "
        "tokens after the prompt), so the pair states no preference and trains nothing: fix "
        "the pair or leave it out of the data")
    assert message(2) == (
        "sample 2 (pairs.jsonl line 5): the rejected answer is empty, so it has nothing to "
        "score: give it text, or leave the pair out of the data")
    assert message(3) == (
        "sample 3 (pairs.jsonl line 7): its prompt is 4 tokens, so max_length=4 leaves no room "
        "for an answer (prompts are never cut): raise max_length above 4, shorten the prompt, "
        "or leave the pair out of the data")
    assert message(4) == (
        "sample 4 (pairs.jsonl line 9): the chosen and rejected answers are identical (2 "
        "tokens after the prompt), so the pair states no preference and trains nothing: fix "
        "the pair or leave it out of the data")
    assert message(5) == (
        "sample 5 (pairs.jsonl line 11): the chosen answer is empty (its assistant messages "
        "have no text), so it has nothing to score: give it text, or leave the pair out of "
        "the data")
    assert message(6) == (
        "sample 6 (pairs.jsonl line 13): the chosen answer is an empty conversation, so it "
        "has nothing to score: give its assistant message, or leave the pair out of the data")
    assert message(7) == (
        "sample 7 (pairs.jsonl line 15): the chosen and rejected answers differ only after "
        "max_length=4 (their first 3 tokens are identical), so the cut pair would train "
        "nothing: raise max_length, or leave the pair out of the data")
    assert dataset[0]["chosen_input_ids"] == ids("how are you fine")  # the good one reads


def test_malformed_triples_and_arguments_are_refused(tokenizer, tmp_path) -> None:
    def message(triple: Any) -> str:
        return refused(lambda: PreferenceDataset([triple], tokenizer)[0])

    assert message({"prompt": "hi", "chosen": " hello"}) == (
        "sample 0 has no 'rejected' key (its keys: ['chosen', 'prompt']): give prompt_key=, "
        "chosen_key=, rejected_key= the keys that hold the prompt and the two answers")
    assert message(["hi"]) == (
        "sample 0 is a list, not an object with 'prompt', 'chosen', 'rejected' keys")
    assert message({"prompt": "hi", "chosen": [assistant("hello")], "rejected": 3}) == (
        "sample 0: prompt is a string, chosen is a message list, rejected is a int: give "
        "three strings (plain text) or three lists of {'role', 'content'} messages (a "
        "conversation)")
    assert message({**CHAT, "prompt": [user("hi"), assistant("hello")]}) == (
        "sample 0: the prompt ends with an assistant message: the answers are the "
        "assistant's next turn, so end the prompt with a user (or tool) message and put the "
        "assistant's reply in the answers")
    assert message({**CHAT, "prompt": []}) == (
        "sample 0: the prompt is an empty conversation: give at least a user message")
    assert message({**CHAT, "rejected": [user("hi"), assistant("go")]}) == (
        "sample 0: the rejected answer starts with 'user', not an assistant message: an "
        "answer is the assistant's reply to the prompt (move earlier turns into the prompt)")
    # render_chat's own checks name the part of the sample they read.
    assert message({**CHAT, "chosen": [{"role": "assistant", "content": "hi"},
                                       {"role": "bot", "content": "hi"}]}) == (
        "sample 0 (prompt + chosen answer): message 3 has the unknown role 'bot': the roles "
        "are system, user, assistant, tool")
    assert message({"prompt": "", "chosen": " hello", "rejected": " bad"}) == (
        "sample 0: the prompt is no token, so the answer's first token could not be scored "
        "(a label at position 0 has no logits before it): give the prompt text, or use a "
        "tokenizer that adds a BOS")
    no_template = make_tokenizer()
    no_template.chat_template = None
    assert refused(lambda: PreferenceDataset([CHAT], no_template)[0]).startswith(
        f"the tokenizer {type(no_template).__name__} (built in memory) has no chat template: "
        "set tokenizer.chat_template")
    assert PreferenceDataset([TEXT], no_template)[0]  # text needs no template

    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(TEXT) + "\n{not json\n")
    assert refused(lambda: PreferenceDataset(path, tokenizer)[1]).replace(
        str(path), "bad.jsonl").startswith("sample 1 (bad.jsonl line 2) is not valid JSON: ")
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    assert refused(lambda: PreferenceDataset(empty, tokenizer)) == (
        f"{empty} holds no preference triple")
    assert refused(lambda: PreferenceDataset([], tokenizer)) == (
        "the list holds no preference triple")
    assert refused(lambda: PreferenceDataset([TEXT], tokenizer, max_length=1)) == (
        "max_length=1 must be at least 2 (a prompt token and an answer token) or None")
    assert refused(lambda: PreferenceDataset([TEXT], make_tokenizer(pad=False))) == (
        f"the tokenizer {type(no_template).__name__} has no pad token: pass pad_token_id= (any id "
        "works, padding is masked out; tokenizer.eos_token_id is the usual choice) or set "
        "tokenizer.pad_token")
    assert PreferenceDataset([TEXT], make_tokenizer(pad=False), pad_token_id=END).collate(
        [PreferenceDataset([TEXT], tokenizer)[0]])["input_ids"][1, -1] == END
    with pytest.raises(IndexError, match="^sample 1 is out of range for 1 preference triples$"):
        PreferenceDataset([TEXT], tokenizer)[1]


# TRL 1.16's config still sets transformers' deprecated gradient_checkpointing field.
@pytest.mark.filterwarnings("ignore:`gradient_checkpointing` is deprecated:FutureWarning",
                            "ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")
def test_batches_equal_trls_tokenization_and_collation(tokenizer) -> None:
    """TRL's DPOTrainer tokenizes the same triples (prompt and completion ids, EOS appended to
    text answers, the chat template for conversations) and collates them [chosen; rejected]
    with a completion mask: our batch is the same, labels being the ids on the completion."""
    from datasets import Dataset
    from trl import DPOConfig, DPOTrainer

    from tests.helpers.hf import build

    triples = {"text": [TEXT, {"prompt": "hi", "chosen": " hello how are you",
                               "rejected": " go away"}],
               "chat": [CHAT, {"prompt": [user("weather today")],
                               "chosen": [assistant("sunny")], "rejected": [assistant("rain")]}]}
    for kind, data in triples.items():
        args = DPOConfig(output_dir=tempfile.mkdtemp(), report_to=[], use_cpu=True,
                         gradient_checkpointing=False, bf16=False)
        trainer = DPOTrainer(model=build("llama"), ref_model=build("llama"), args=args,
                             processing_class=tokenizer, train_dataset=Dataset.from_list(data))
        theirs = trainer.data_collator([trainer.train_dataset[i] for i in range(len(data))])
        dataset = PreferenceDataset(data, tokenizer)
        ours = dataset.collate([dataset[i] for i in range(len(data))])
        assert torch.equal(ours["input_ids"], theirs["input_ids"]), kind
        assert torch.equal(ours["attention_mask"], theirs["attention_mask"]), kind
        expected = theirs["input_ids"].masked_fill(theirs["completion_mask"] == 0, X)
        assert torch.equal(ours["labels"], expected), kind
