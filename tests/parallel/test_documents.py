"""Attention inside packed documents: a packed sample of k documents gives each document the
logits, loss and gradients it has alone, for a GPT with rotary positions of its own and for
transformers' Llama and Qwen3, whose code is unchanged."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dream_trainer.data import ShardedStream
from dream_trainer.data.documents import IGNORE
from dream_trainer.parallel.documents import documents
from tests.helpers.rotary_gpt import VOCAB, RotaryGPT

# The packed and the lone runs compute each document's attention with other kernels (one
# masked call over the sample, against a causal call over the document), so they agree to
# float32 rounding at logits of scale ~1: 1e-6 absolute, the bound.
TOLERANCE = 1e-6
LENGTHS = (5, 7, 4)


def packed_sample(vocab: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """One sample of the three documents, as ``ShardedStream`` packs them."""
    generator = torch.Generator().manual_seed(seed)
    source = [{"input_ids": torch.randint(0, vocab, (n,), generator=generator).tolist()}
              for n in LENGTHS]
    stream = ShardedStream(source, shuffle=False, sequence_length=sum(LENGTHS),
                           documents=True)
    return {key: value.unsqueeze(0) for key, value in stream.sample(0).items()}


def pieces(sample: dict[str, torch.Tensor]) -> list[slice]:
    ids = sample["document_ids"][0].tolist()
    starts = [i for i in range(len(ids)) if i == 0 or ids[i] != ids[i - 1]]
    return [slice(a, b) for a, b in zip(starts, [*starts[1:], len(ids)], strict=True)]


def gpt() -> nn.Module:
    torch.manual_seed(0)
    return RotaryGPT(layers=2)


def summed_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1),
                           ignore_index=IGNORE, reduction="sum")


def test_a_packed_gpt_sample_gives_each_document_its_lone_logits_loss_and_gradients() -> None:
    model = gpt()
    sample = packed_sample(VOCAB)
    with documents(sample["document_ids"], sample["position_ids"]):
        logits = model(sample["input_ids"], sample["position_ids"])
        loss = summed_loss(logits, sample["targets"])
        loss.backward()
    packed_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    alone_loss = torch.zeros(())
    for piece in pieces(sample):
        ids = sample["input_ids"][:, piece]
        alone = model(ids)  # positions 0, 1, ... and plain causal attention
        assert (logits[:, piece] - alone).abs().max() <= TOLERANCE
        targets = sample["targets"][:, piece]
        assert targets[0, -1] == IGNORE  # no target crosses into the next document
        alone_loss = alone_loss + summed_loss(alone, targets)
    alone_loss.backward()
    assert abs(float(loss) - float(alone_loss)) <= TOLERANCE * float(alone_loss)
    for packed, lone in zip(packed_grads, (p.grad for p in model.parameters()), strict=True):
        assert (packed - lone).abs().max() <= TOLERANCE
    # Without the context the documents see each other: the check above can fail.
    crossed = model(sample["input_ids"], sample["position_ids"])
    assert (crossed[:, pieces(sample)[1]] - logits[:, pieces(sample)[1]]).abs().max() > 1e-3


@pytest.mark.parametrize("architecture", ["llama", "qwen3"])
@pytest.mark.parametrize("use_cache", [True, False])
def test_a_transformers_decoder_keeps_its_documents_apart_unchanged(architecture: str,
                                                                    use_cache: bool) -> None:
    from tests.helpers.hf import VOCAB as HF_VOCAB
    from tests.helpers.hf import build

    torch.manual_seed(0)
    model = build(architecture).eval()  # type: ignore[arg-type]
    sample = packed_sample(HF_VOCAB, seed=1)
    # The model is called as it always is: the context gives it the documents' positions
    # and mask, whether transformers' cache (which hides packing from it) is on or off.
    with documents(sample["document_ids"], sample["position_ids"], [model]):
        logits = model(sample["input_ids"], use_cache=use_cache).logits
    for piece in pieces(sample):
        alone = model(sample["input_ids"][:, piece], use_cache=use_cache).logits
        assert (logits[:, piece] - alone).abs().max() <= TOLERANCE
    # Without the context transformers' default call mixes them (its cache is on).
    crossed = model(sample["input_ids"]).logits
    assert (crossed[:, pieces(sample)[1]] - logits[:, pieces(sample)[1]]).abs().max() > 1e-3


def test_an_attention_mask_or_another_length_is_refused_inside_the_context() -> None:
    from tests.helpers.hf import VOCAB as HF_VOCAB
    from tests.helpers.hf import build

    torch.manual_seed(0)
    model = build("llama").eval()
    sample = packed_sample(HF_VOCAB)
    with documents(sample["document_ids"], sample["position_ids"], [model]):
        with pytest.raises(ValueError) as error:
            model(sample["input_ids"], attention_mask=torch.ones_like(sample["input_ids"]))
    assert str(error.value) == (
        "LlamaForCausalLM was given an attention_mask inside the documents context: the "
        "documents' mask is the attention mask there (a packed sample has no padding); call "
        "the model without attention_mask")
    query = torch.zeros(1, 2, 5, 4)
    with documents(sample["document_ids"]):
        with pytest.raises(ValueError, match="attention over 5 queries and 5 keys inside the "
                                             "documents context, whose sequences are 16"):
            F.scaled_dot_product_attention(query, query, query, is_causal=True)
    with pytest.raises(ValueError, match=r"position_ids of shape \(1, 3\) and document_ids"):
        with documents(sample["document_ids"], torch.zeros(1, 3, dtype=torch.long)):
            pass
    # The context puts torch's own function back, also after an error inside it.
    assert F.scaled_dot_product_attention is torch._C._nn.scaled_dot_product_attention


def test_under_context_parallelism_transformers_rotary_positions_are_the_documents() -> None:
    from dream_trainer.parallel.context_hf import HFDecoders
    from dream_trainer.parallel.context_split import SequenceSplit

    # Rank 1 of cp=2, balanced: it holds positions 4-11 of 16 (chunks 1 and 2 of 4).
    split = SequenceSplit(16, 2, 1, True, torch.device("cpu"))
    sample = packed_sample(VOCAB)  # documents of 5, 7 and 4 tokens
    decoders = HFDecoders({}, 2, lambda: split, lambda: None,
                          lambda: sample["position_ids"])
    local = torch.arange(8).unsqueeze(0)  # what a rotary embedding is called with
    args, kwargs = decoders._global_positions(nn.Identity(), (None, local), {})
    assert args[1].tolist() == [[4, 0, 1, 2, 3, 4, 5, 6]]
    assert torch.equal(args[1], sample["position_ids"][:, 4:12])
    # Without documents the positions held are the sequence's own.
    plain = HFDecoders({}, 2, lambda: split, lambda: None)
    _, kwargs = plain._global_positions(nn.Identity(), (), {"position_ids": local})
    assert kwargs["position_ids"].tolist() == [list(range(4, 12))]


@pytest.mark.parametrize("causal", [True, False])
def test_the_flex_attention_path_equals_the_masked_one(causal: bool) -> None:
    # CUDA runs the documents through FlexAttention's block mask; its forward runs (eagerly)
    # on the CPU too, so the two paths are compared here; its backward needs CUDA (the GPU
    # rows). Two kernels of one softmax: within float32 rounding of outputs of scale ~1.
    import warnings

    from dream_trainer.parallel.documents import (DocumentAttention, document_block_mask,
                                                  flex_documents)

    sample = packed_sample(VOCAB)
    ids = sample["document_ids"].repeat(2, 1)  # two sequences
    generator = torch.Generator().manual_seed(0)
    query = torch.randn(2, 4, 16, 8, generator=generator)
    key, value = (torch.randn(2, 2, 16, 8, generator=generator) for _ in range(2))
    masked = DocumentAttention(ids, F.scaled_dot_product_attention).attend(
        query, key, value, is_causal=causal, enable_gqa=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # eager FlexAttention warns that it is slow
        flex = flex_documents(query, key, value, document_block_mask(ids, causal), None, True)
    assert (flex - masked).abs().max() <= TOLERANCE
