"""Script: a tiny transformers MoE (Qwen3-MoE or Mixtral) with its MoE blocks replaced by
``dream_trainer.nn.MoE`` (or as transformers builds it, for the ``*_asis`` layouts), loaded
with ``init_weights_from`` from what ``save_pretrained`` wrote, fine-tuned a few steps, and
exported from inside the run (``export_weights`` to ROOT_DIR/live_<family>_<layout>); the
final checkpoint is left in ROOT_DIR for ``dream-trainer export``. Rank 0 saves, per layout
and family, the logits after the load and at the end, and the file tensors each rank read.

    torchrun --nproc_per_node=N hf_moe_run.py OUT ROOT_DIR LAYOUT[,LAYOUT] FAMILY=DIR ...
"""

from __future__ import annotations

import itertools
import sys
from pathlib import Path
from typing import Any, Literal
from unittest import mock

import torch
from torch import nn
from transformers import MixtralConfig, MixtralForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

from dream_trainer.configs import CheckpointParameters, DeviceParameters
from dream_trainer.mixins import CheckpointConfigMixin, CheckpointMixin
from dream_trainer.nn import replace_hf_moe_blocks
from dream_trainer.weights.hf_reader import SliceReader
from dream_trainer.world.agree import gather_objects
from tests.helpers.hf import HFConfig, HFTrainer, fixed_batch, hf_config, logits
from tests.helpers.launch import save_on_rank_zero

Family = Literal["qwen3_moe", "mixtral"]
SHAPE = {"vocab_size": 64, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "max_position_embeddings": 32, "num_experts_per_tok": 2,
         "tie_word_embeddings": False}
LAYOUTS = {"one": DeviceParameters.SINGLE_DEVICE(),
           "ep2": DeviceParameters(expert_parallel=2),  # 2 ranks: 2 of the 4 experts each
           "fsdp": DeviceParameters.FSDP(),  # the stacked experts sharded on their first dim
           # The model as transformers builds it, its blocks not converted.
           "one_asis": DeviceParameters.SINGLE_DEVICE(),
           "fsdp_asis": DeviceParameters.FSDP()}


def build(family: Family) -> nn.Module:
    """The transformers model, 4 experts per layer (Qwen3-MoE normalizing its top-2
    weights, Mixtral always does)."""
    if family == "mixtral":
        return MixtralForCausalLM(MixtralConfig(**SHAPE, intermediate_size=48,
                                                num_local_experts=4))
    return Qwen3MoeForCausalLM(Qwen3MoeConfig(**SHAPE, intermediate_size=48,
                                              moe_intermediate_size=24, num_experts=4,
                                              head_dim=8, norm_topk_prob=True))


def save_pretrained(family: Family, path: Path) -> nn.Module:
    torch.manual_seed(0)
    model = build(family).eval()
    model.save_pretrained(path)
    return model


class MoEConfig(HFConfig, CheckpointConfigMixin):
    family: Family = "qwen3_moe"
    convert: bool = True
    """Replace the transformers blocks by ``MoE`` layers (False: train the model as it is)."""


class MoERun(HFTrainer, CheckpointMixin):
    """The transformers MoE with ``MoE`` layers; logits after setup and at the end, and a
    live export."""

    config: MoEConfig
    export_dir: Path
    read: list[str]  # the file tensors this rank's reader read, filled during the load

    def configure_models(self) -> None:
        self.model = build(self.config.family)
        if self.config.convert:
            replace_hf_moe_blocks(self.model)

    def post_setup(self) -> None:
        super().post_setup()
        self.read_by_rank = gather_objects(sorted(set(self.read)))
        self.initial = logits(self.model, fixed_batch())

    def post_fit(self) -> None:
        super().post_fit()
        self.final = logits(self.model, fixed_batch())
        self.exported = self.export_weights(self.export_dir)


def run(family: Family, pretrained: Path, root: Path, layout: str,
        read: list[str] | None = None, batch: int = 4) -> MoERun:
    """Load, fine-tune 3 steps of ``batch`` sequences per rank and export, in ``root``."""
    base = hf_config(device_parameters=LAYOUTS[layout], init_weights_from=pretrained, lr=0.5,
                     batch=batch)
    config = MoEConfig(**{**dict(base), "experiment": f"{family}_{layout}"}, family=family,
                       checkpoint_parameters=CheckpointParameters(root_dir=root),
                       convert=not layout.endswith("_asis"))
    trainer = MoERun(config)
    trainer.export_dir = root / f"live_{family}_{layout}"
    trainer.read = [] if read is None else read
    trainer.fit()
    return trainer


def main(out: str, root: str, layouts: str, *sources: str) -> None:
    results: dict[tuple[str, str], Any] = {}
    for layout, source in itertools.product(layouts.split(","), sources):
        family, _, pretrained = source.partition("=")
        read: list[str] = []
        original = SliceReader.read_data

        def recording(reader: SliceReader, plan: Any, planner: Any) -> Any:
            read.extend(item.storage_index.fqn for item in plan.items)
            return original(reader, plan, planner)

        with mock.patch.object(SliceReader, "read_data", recording):
            trainer = run(family, Path(pretrained), Path(root), layout,  # type: ignore[arg-type]
                          read)
        results[layout, family] = {"initial": trainer.initial, "final": trainer.final,
                           "exported": {name: str(path) for name, path
                                        in trainer.exported.items()},
                           "checkpoint": str(trainer.checkpoint_dir
                                             / f"step_{trainer.global_step}"),
                           "read": trainer.read_by_rank}
    save_on_rank_zero(results, out, "hf_moe_run")


if __name__ == "__main__":
    main(*sys.argv[1:])
