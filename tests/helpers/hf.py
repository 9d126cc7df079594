"""Tiny Hugging Face causal LMs, and a trainer for them, for the pretrained-weights tests.

Importing this module imports ``transformers`` (a test dependency, never one of
dream_trainer's).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.utils.data import DataLoader, TensorDataset
from transformers import (GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM,
                          Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM)

from dream_trainer import BaseTrainer, BaseTrainerConfig
from dream_trainer.configs import DeviceParameters, TrainingParameters
from dream_trainer.mixins import SetupConfigMixin, SetupMixin
from dream_trainer.nn import replace_hf_moe_blocks

VOCAB, SEQ = 64, 16
Architecture = Literal["llama", "llama_tied", "gpt2", "qwen3", "qwen3_moe"]


def llama_config(layers: int = 2, tied: bool = False) -> LlamaConfig:
    """Two layers, grouped-query attention (4 heads, 2 key/value heads), the head untied
    (or tied to the embedding, as Llama-3.2-1B's)."""
    return LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                       num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                       max_position_embeddings=2 * SEQ, tie_word_embeddings=tied)


def qwen3_config(layers: int = 4) -> Qwen3Config:
    """Qwen3's layout (q/k norms, explicit head dimension), untied head."""
    return Qwen3Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                       num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                       head_dim=8, max_position_embeddings=2 * SEQ, tie_word_embeddings=False)


def qwen3_moe_config(layers: int = 4) -> Qwen3MoeConfig:
    """Qwen3's layout with a mixture of 4 experts in every layer (top 2, weights normalized)."""
    return Qwen3MoeConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48,
                          moe_intermediate_size=24, num_experts=4, num_experts_per_tok=2,
                          norm_topk_prob=True, num_hidden_layers=layers, num_attention_heads=4,
                          num_key_value_heads=2, head_dim=8, max_position_embeddings=2 * SEQ,
                          tie_word_embeddings=False)


def gpt2_config() -> GPT2Config:
    """GPT-2's layout: learned positions, LayerNorm, and the head tied to the embedding."""
    return GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=SEQ,
                      bos_token_id=0, eos_token_id=0)


def build(architecture: Architecture, layers: int = 2) -> nn.Module:
    if architecture in ("llama", "llama_tied"):
        return LlamaForCausalLM(llama_config(layers, tied=architecture == "llama_tied"))
    if architecture == "qwen3":
        return Qwen3ForCausalLM(qwen3_config(layers))
    if architecture == "qwen3_moe":
        return Qwen3MoeForCausalLM(qwen3_moe_config(layers))
    return GPT2LMHeadModel(gpt2_config())


def save_pretrained(architecture: Architecture, path: Path, seed: int = 0,
                    layers: int = 2) -> nn.Module:
    """Build the model eagerly with random weights, as a download would provide them, and
    ``save_pretrained`` it; returns the model."""
    torch.manual_seed(seed)
    model = build(architecture, layers).eval()
    model.save_pretrained(path)
    return model


def fixed_batch() -> torch.Tensor:
    return torch.randint(0, VOCAB, (4, SEQ), generator=torch.Generator().manual_seed(1))


def logits(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """The model's logits in eval mode (dropout off), then back to its previous mode."""
    was_training = model.training
    model.eval()
    with torch.no_grad():
        out = model(input_ids=tokens).logits.detach().clone()
    model.train(was_training)
    return out


def llama_tensor_parallel_plan() -> dict[str, Any]:
    """A Llama block's tensor-parallel plan. Llama's attention infers its head count from the
    projection's width, so a column-parallel q/k/v carries this rank's heads and o_proj sums
    their outputs."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    return {"self_attn.q_proj": ColwiseParallel(), "self_attn.k_proj": ColwiseParallel(),
            "self_attn.v_proj": ColwiseParallel(), "self_attn.o_proj": RowwiseParallel(),
            "mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel(),
            "mlp.down_proj": RowwiseParallel()}


def gathered_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every weight of ``model`` (DDP's wrapped one), whole, on every rank (a pipeline rank
    holds its stages'; gathered over the ranks)."""
    import torch.distributed as dist

    from dream_trainer.parallel.dtensor import full_value
    from dream_trainer.parallel.names import clean_name

    model = getattr(model, "module", model)
    mine = {clean_name(name): full_value(param).detach().clone()
            for name, param in model.named_parameters()}
    if not dist.is_initialized():
        return mine
    pieces: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(pieces, mine)
    return {name: value for piece in pieces for name, value in piece.items()}


class HFConfig(BaseTrainerConfig, SetupConfigMixin):
    architecture: Architecture = "llama"
    layers: int = 2
    lr: float = 0.05


def hf_config(architecture: Architecture = "llama", batch: int = 4,
              device_parameters: DeviceParameters | None = None, **fields: Any) -> HFConfig:
    training = fields.pop("training_parameters", None) or TrainingParameters(
        n_epochs=1, train_batch_size=batch, max_steps=3)
    return HFConfig(project="hf", group="tests", experiment=architecture,
                    architecture=architecture, training_parameters=training,
                    device_parameters=device_parameters or DeviceParameters.SINGLE_DEVICE(),
                    **fields)


class HFTrainer(BaseTrainer, SetupMixin):
    """Fine-tunes a tiny causal LM with SGD on random tokens (a mixture-of-experts model with
    dream_trainer's ``MoE`` layers in place of its transformers blocks)."""

    config: HFConfig

    def configure_models(self) -> None:
        self.model = build(self.config.architecture, self.config.layers)
        replace_hf_moe_blocks(self.model)  # nothing to replace in a dense model

    def apply_tensor_parallel(self, tp_mesh: DeviceMesh) -> None:
        from torch.distributed.tensor.parallel import parallelize_module

        for layer in self.model.model.layers:
            parallelize_module(layer, tp_mesh, llama_tensor_parallel_plan())

    def configure_optimizers(self) -> None:
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=self.config.lr)

    def configure_dataloaders(self) -> tuple[DataLoader[Any], None]:
        tokens = torch.randint(0, VOCAB, (32, SEQ), generator=torch.Generator().manual_seed(2))
        return DataLoader(TensorDataset(tokens),
                          batch_size=self.config.training_parameters.train_batch_size), None

    def training_step(self, batch: Any, batch_idx: int) -> dict[str, Any]:
        (tokens,) = batch
        loss = self.model(input_ids=tokens, labels=tokens).loss
        self.backward(loss)
        self.step(self.model, self.optimizer)
        return {"loss": loss}

    def validation_step(self, batch: Any, batch_idx: int) -> dict[str, Any]:
        return {}


def summed_loss(output: Any, targets: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of a causal LM's logits (a pipeline's last stage returns them bare)
    against already-shifted targets, summed over the tokens not ignored (-100)."""
    import torch.nn.functional as F

    logits = getattr(output, "logits", output)
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), ignore_index=-100,
                           reduction="sum")


class RecordingHFTrainer(HFTrainer):
    """``HFTrainer`` that keeps every weight, whole, after setup (``initial``) and at the end
    of ``fit()`` (``final``), on every rank."""

    def post_setup(self) -> None:
        super().post_setup()
        self.initial = gathered_weights(self.model)

    def post_fit(self) -> None:
        super().post_fit()
        self.final = gathered_weights(self.model)
