"""Script: DPO of a tiny transformers Llama against a frozen reference model (both read from the
same saved base), one run per layout in one launch; rank 0 saves each run's initial and
final weights of both models (every rank's, gathered), the losses, and which reference
parameters hold gradients or optimizer state.

    torchrun --nproc_per_node=N dpo_run.py OUT BASE LAYOUT [LAYOUT ...]

A ``_lora`` layout trains LoRA adapters on the policy and takes the base with its adapters
switched off as the reference (no second model); ``_lorapair`` trains the same adapters
against a separate reference model read from the same base.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader, TensorDataset

from dream_trainer.callbacks import ReferenceLogProbs
from dream_trainer.configs import DeviceParameters, TrainingParameters
from dream_trainer.nn import dpo_loss, sequence_log_probs
from tests.helpers.hf import (SEQ, VOCAB, RecordingHFTrainer, build, gathered_weights,
                              hf_config, llama_tensor_parallel_plan)
from tests.helpers.launch import save_on_rank_zero

LAYOUTS = {"single": DeviceParameters.SINGLE_DEVICE(), "ddp": DeviceParameters.DDP(),
           "fsdp": DeviceParameters.FSDP(), "hsdp": DeviceParameters.HSDP(dp_shard=2),
           "tp": DeviceParameters(tensor_parallel=2, dp_shard=1),
           "cp": DeviceParameters(context_parallel=2, dp_shard=1)}
DATA_PARALLEL = {"ddp": 2, "fsdp": 2, "hsdp": 4}
PAIRS, GLOBAL_BATCH, STEPS, PROMPT, BETA = 24, 4, 3, 6, 0.1
IGNORE = -100


def preference_pairs() -> tuple[torch.Tensor, torch.Tensor]:
    """Chosen and rejected sequences sharing their first PROMPT tokens."""
    generator = torch.Generator().manual_seed(3)
    chosen = torch.randint(0, VOCAB, (PAIRS, SEQ), generator=generator)
    rejected = torch.randint(0, VOCAB, (PAIRS, SEQ), generator=generator)
    rejected[:, :PROMPT] = chosen[:, :PROMPT]
    return chosen, rejected


def response_targets(tokens: torch.Tensor) -> torch.Tensor:
    """Next-token targets of the answer only: the prompt's (and the last position's) ignored."""
    targets = torch.cat([tokens[:, 1:], torch.full_like(tokens[:, :1], IGNORE)], 1)
    targets[:, :PROMPT - 1] = IGNORE
    return targets


def logits_of(output: Any) -> torch.Tensor:
    return getattr(output, "logits", output)


def pair_dataset() -> TensorDataset:
    """``(index, chosen, rejected)`` items."""
    chosen, rejected = preference_pairs()
    return TensorDataset(torch.arange(PAIRS), chosen, rejected)


def pair_log_probs(trainer: DPOTrainer, model: Any, batch: Any) -> torch.Tensor:
    """``ReferenceLogProbs``' ``compute``: ``[pairs, 2]``, chosen then rejected."""
    _, chosen, rejected = batch
    values = trainer.reference_log_probs(torch.cat([chosen, rejected]),
                                         response_targets(torch.cat([chosen, rejected])))
    return torch.stack([values[:len(chosen)], values[len(chosen):]], 1)


class DPOTrainer(RecordingHFTrainer):
    """The policy ``model`` trains; ``reference``, frozen, gives the reference log-probs (each
    step, or once before the first with ``precomputed``)."""

    precomputed: ReferenceLogProbs | None = None

    lora = False  # LoRA adapters on the policy
    pair = True  # a separate reference model (else the base, adapters off)

    def configure_models(self) -> None:
        super().configure_models()
        if self.lora:
            from peft import get_peft_model

            from tests.scripts.lora_run import lora_config

            self.model = get_peft_model(self.model, lora_config())
        if self.pair:
            self.reference = build("llama").requires_grad_(False)

    def apply_tensor_parallel(self, tp_mesh: Any) -> None:
        from torch.distributed.tensor.parallel import parallelize_module

        from dream_trainer.parallel.lora import lora_tensor_parallel_plan

        models = [self.model, self.reference] if self.pair else [self.model]
        for model in models:
            inner = model.base_model.model if model is self.model and self.lora else model
            for layer in inner.model.layers:
                parallelize_module(layer, tp_mesh,
                                   lora_tensor_parallel_plan(layer, llama_tensor_parallel_plan()))

    def configure_optimizers(self) -> None:
        self.optimizer = torch.optim.SGD(
            [p for p in self.model.parameters() if p.requires_grad], lr=self.config.lr)

    def configure_dataloaders(self) -> tuple[DataLoader[Any], None]:
        return DataLoader(pair_dataset(),
                          batch_size=self.config.training_parameters.train_batch_size), None

    def reference_log_probs(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The reference's summed answer log-probs, whole sequences (cp: the ranks' parts
        summed), without gradients."""
        def summed(output: Any, target: torch.Tensor) -> torch.Tensor:
            return sequence_log_probs(logits_of(output), target, shifted=True)[0]

        if not self.pair:
            with self.model.disable_adapter():
                return self.forward_loss(self.model, tokens, target=targets, loss_fn=summed,
                                         num_items=1)
        return self.forward_loss(self.reference, tokens, target=targets, loss_fn=summed,
                                 num_items=1)

    def training_step(self, batch: Any, batch_idx: int) -> dict[str, Any]:
        indices, chosen, rejected = batch
        tokens = torch.cat([chosen, rejected])  # one forward pass for both, as TRL does
        targets = response_targets(tokens)
        pairs = len(chosen)
        if self.precomputed is not None:  # computed once, before the first step
            reference = self.precomputed.lookup(indices).T.flatten()
        else:
            reference = self.reference_log_probs(tokens, targets)

        def loss_fn(output: Any, target: torch.Tensor) -> torch.Tensor:
            policy = self.sequence_sum(sequence_log_probs(logits_of(output), target, shifted=True)[0])
            losses, _ = dpo_loss(policy[:pairs], policy[pairs:], reference[:pairs],
                                 reference[pairs:], beta=BETA)
            return losses.mean()

        loss = self.forward_backward(self.model, tokens, target=targets, loss_fn=loss_fn)
        self.step(self.model, self.optimizer)
        return {"loss": loss}

    def post_fit(self) -> None:
        super().post_fit()
        if self.pair and self.precomputed is None:
            self.reference_final = gathered_weights(self.reference)
            self.reference_grads = [name for name, param in self.reference.named_parameters()
                                    if param.grad is not None]
            self.reference_sharded = any(isinstance(param, DTensor)
                                         for param in self.reference.parameters())


VARIANTS = {"": {}, "lora": {"lora": True, "pair": False}, "lorapair": {"lora": True},
            "pre": {}}
"""``pre``: the reference's log-probs computed once, before the first step
(``ReferenceLogProbs``), and the reference's storage freed."""


def run(layout: str, base: str) -> dict[str, Any]:
    name, _, variant = layout.partition("_")
    ranks = DATA_PARALLEL.get(name, 1)
    kind = type("DPOVariant", (DPOTrainer,), VARIANTS[variant])
    sources = {"model": Path(base), "reference": Path(base)} if kind.pair \
        else {"model": Path(base)}
    config = hf_config(device_parameters=LAYOUTS[name], init_weights_from=sources,
                       training_parameters=TrainingParameters(
                           n_epochs=1, max_steps=STEPS, train_batch_size=GLOBAL_BATCH // ranks))
    trainer = kind(config)
    if variant == "pre":
        attach_precomputed(trainer)
    trainer.fit()
    result: dict[str, Any] = {"initial": trainer.initial, "final": trainer.final,
                              "steps": trainer.global_step,
                              "optimized": sum(len(group["params"]) for group
                                               in trainer.optimizer.param_groups)}
    if kind.pair and variant != "pre":
        result.update(reference_final=trainer.reference_final,
                      reference_grads=trainer.reference_grads,
                      reference_sharded=trainer.reference_sharded)
    return result


def attach_precomputed(trainer: DPOTrainer) -> None:
    """Give ``trainer`` the reference's log-probs of every pair, computed before the first step."""
    from torch.utils.data import default_collate

    trainer.precomputed = ReferenceLogProbs("reference", pair_dataset(), default_collate,
                                            pair_log_probs, batch_size=4)
    trainer.callbacks.append(trainer.precomputed)
    trainer.callbacks.attach(trainer)


def main(out: str, base: str, layouts: list[str]) -> None:
    save_on_rank_zero({layout: run(layout, base) for layout in layouts}, out, "dpo")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3:])
