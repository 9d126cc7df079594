"""Script: the LoRA runs beyond lora_run.py's, one run per layout in one launch; rank 0 saves
each run's initial and final weights (every rank's, gathered).

- ``llama_<layout>``: lora_run.py's fine-tune of a tiny Llama (r=4 on the attention and MLP
  projections), exported merged (``format="hf", merge_adapters=True``) to
  EXPORT_ROOT/<run> at the end;
- ``moe_<layout>``: a tiny Qwen3-MoE, its MoE blocks replaced by ``MoE`` layers
  (``replace_hf_moe_blocks``), with LoRA on the attention projections only (the experts and
  the router left alone), exported merged the same way;
- ``experts_ep2``: that MoE with LoRA on its experts too (peft's ``target_parameters``), which
  expert parallelism refuses: the run saves the error's message.

    torchrun --nproc_per_node=N lora_extra_run.py OUT EXPORT_ROOT RUN [RUN ...]
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch

from dream_trainer.configs import DeviceParameters, TrainingParameters
from dream_trainer.nn import replace_hf_moe_blocks
from tests.helpers.hf import build, hf_config
from tests.helpers.launch import save_on_rank_zero
from tests.scripts.lora_run import GLOBAL_BATCH, STEPS, LoraTrainer

LAYOUTS = {"single": DeviceParameters.SINGLE_DEVICE(), "ddp": DeviceParameters.DDP(),
           "fsdp": DeviceParameters.FSDP(), "tp": DeviceParameters(tensor_parallel=2, dp_shard=1),
           "pp": DeviceParameters(pipeline_parallel=2, dp_shard=1),
           # 2 ranks: 2 of the 4 experts each, FSDP2 over the same ranks for the rest.
           "ep2": DeviceParameters(expert_parallel=2)}
DATA_PARALLEL = {"ddp": 2, "fsdp": 2, "ep2": 2}
ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]


def attention_lora_config(**fields: Any) -> Any:
    from peft import LoraConfig

    return LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=ATTENTION, **fields)


class MergingLoraTrainer(LoraTrainer):
    """lora_run.py's trainer, exporting the merged model at the end of ``fit()``."""

    merged_dir: str | Path | None = None  # a directory or an object-store URL
    merged_dtype: torch.dtype | None = None

    def post_fit(self) -> None:
        super().post_fit()
        if self.merged_dir is not None:
            self.export_weights(self.merged_dir, format="hf", merge_adapters=True,
                                dtype=self.merged_dtype)


class MoELoraTrainer(MergingLoraTrainer):
    """The same loop on a Qwen3-MoE whose blocks are ``MoE`` layers, LoRA on attention (and
    on the experts' gate projections with ``adapt_experts``)."""

    adapt_experts = False

    def configure_models(self) -> None:
        from peft import get_peft_model

        model = build("qwen3_moe", self.config.layers)
        replace_hf_moe_blocks(model)
        experts = {"target_parameters": ["experts.w1"]} if self.adapt_experts else {}
        self.model = get_peft_model(model, attention_lora_config(**experts))


def run(name: str, export_root: str | None = None) -> dict[str, Any]:
    family, _, layout = name.partition("_")
    ranks = DATA_PARALLEL.get(layout, 1)
    config = hf_config(family if family == "llama" else "qwen3_moe",
                       device_parameters=LAYOUTS[layout],
                       training_parameters=TrainingParameters(
                           n_epochs=1, max_steps=STEPS, train_batch_size=GLOBAL_BATCH // ranks))
    trainer = (MergingLoraTrainer if family == "llama" else MoELoraTrainer)(config)
    if family == "experts":
        trainer.adapt_experts = True
        try:
            trainer.fit()
        except ValueError as error:
            return {"error": str(error)}
        raise AssertionError("expert parallelism trained LoRA on the experts")
    if export_root is not None:
        trainer.merged_dir = Path(export_root) / name
    trainer.fit()
    return {"initial": trainer.initial, "final": trainer.final, "trainable": trainer.trainable,
            "steps": trainer.global_step}


def main(out: str, export_root: str, names: list[str]) -> None:
    save_on_rank_zero({name: run(name, export_root) for name in names}, out, "lora_extra")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3:])
