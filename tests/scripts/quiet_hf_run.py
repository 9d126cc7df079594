"""Script: fine-tune a tiny transformers Llama for 2 optimizer steps in one process, with
dream_trainer imported first (as isort orders ``dream_trainer`` before ``transformers``).

Usage: quiet_hf_run.py [--transformers-first]

``--transformers-first`` imports transformers before dream_trainer, so that the records it
causes while importing are emitted before dream_trainer's filters exist: the control that
shows what the filters remove.
"""

from __future__ import annotations

import sys

if "--transformers-first" in sys.argv:
    from transformers import LlamaForCausalLM  # noqa: F401  (it imports torchao)

import torch
from torch.utils.data import DataLoader, TensorDataset

from dream_trainer import BaseTrainer, BaseTrainerConfig
from dream_trainer.configs import TrainingParameters
from dream_trainer.mixins import SetupConfigMixin, SetupMixin


class TinyConfig(BaseTrainerConfig, SetupConfigMixin):
    pass


class TinyLlama(BaseTrainer, SetupMixin):
    def configure_models(self) -> None:
        from transformers import LlamaConfig, LlamaForCausalLM

        self.model = LlamaForCausalLM(LlamaConfig(
            vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
            num_attention_heads=2, num_key_value_heads=2))

    def configure_optimizers(self) -> None:
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-3)

    def configure_dataloaders(self) -> tuple[DataLoader, None]:
        tokens = torch.randint(1, 64, (8, 9), generator=torch.Generator().manual_seed(0))
        return DataLoader(TensorDataset(tokens), batch_size=4), None

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> dict[str, torch.Tensor]:
        (tokens,) = batch
        loss = self.model(input_ids=tokens, labels=tokens).loss
        self.backward(loss)
        self.step(self.model, self.optimizer)
        return {"loss": loss.detach()}

    def validation_step(self, batch: list[torch.Tensor], batch_idx: int) -> dict[str, float]:
        return {}


trainer = TinyLlama(TinyConfig(project="tests", group="quiet", experiment="hf",
                               training_parameters=TrainingParameters(n_epochs=1,
                                                                      train_batch_size=4)))
trainer.fit()
print(f"trained {trainer.global_step} steps")
