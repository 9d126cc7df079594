"""Per-rank peak memory and time of loading a Hugging Face checkpoint into FSDP2 on 2 ranks.

Compares ``init_weights_from`` (the model built on the meta device, sharded, materialized
shard by shard, then each rank reads only its slices of the safetensors file) with the
usual way: ``AutoModelForCausalLM.from_pretrained`` on every rank, then ``fully_shard``.
Both run through the same trainer and are measured at the same points: memory is the
per-rank peak RSS during configure and setup above the RSS before them (torch, FSDP2,
DTensor, DCP and transformers' Llama code already imported), as a fraction of the fp32
model size; time is configure plus setup. The checkpoint is a Llama with random weights
written as one ``model.safetensors``, as ``save_pretrained`` writes a model of this size.

    python -m benchmarks.hf_load_memory             # a model of 1.16 GiB
    python -m benchmarks.hf_load_memory --size-mb 256
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch._dynamo  # noqa: F401  (part of the baseline, as in meta_init_memory)
import torch.distributed.checkpoint  # noqa: F401
import torch.distributed.fsdp  # noqa: F401
import torch.distributed.tensor  # noqa: F401

from benchmarks.processes import child_env
from benchmarks.setup_only import SetupOnlyTrainer

from dream_trainer import BaseTrainerConfig
from dream_trainer.configs import DeviceParameters, TrainingParameters
from dream_trainer.mixins import SetupConfigMixin

VARIANTS = ("init_weights_from", "from_pretrained")


def llama_config(size_mb: int) -> Any:
    """A Llama of at least ``size_mb`` MiB of fp32 weights: Llama-2-like widths, as many
    layers as it takes (small widths for the quick run)."""
    from transformers import LlamaConfig

    wide = size_mb >= 256
    hidden, intermediate, vocab = (2048, 5632, 32000) if wide else (256, 688, 4096)
    heads, kv_heads = (16, 4) if wide else (4, 2)
    kv_width = hidden // heads * kv_heads
    per_layer = 2 * hidden * hidden + 2 * hidden * kv_width + 3 * hidden * intermediate \
        + 2 * hidden
    fixed = 2 * vocab * hidden + hidden
    layers = max(1, math.ceil((size_mb * 2**20 / 4 - fixed) / per_layer))
    return LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate,
                       num_hidden_layers=layers, num_attention_heads=heads,
                       num_key_value_heads=kv_heads)


def write_checkpoint(path: Path, size_mb: int) -> int:
    """Save a random-weight Llama in the Hugging Face layout; return its size in bytes."""
    from safetensors.torch import save_file
    from transformers import LlamaForCausalLM

    config = llama_config(size_mb)
    with torch.device("meta"):
        shapes = {key: value.shape for key, value in LlamaForCausalLM(config).state_dict().items()}
    generator = torch.Generator().manual_seed(0)
    tensors = {key: torch.randn(shape, generator=generator) * 0.02
               for key, shape in shapes.items()}
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    config.save_pretrained(path)
    return sum(t.numel() * t.element_size() for t in tensors.values())


class LoadConfig(BaseTrainerConfig, SetupConfigMixin):
    variant: str
    pretrained: Path


class LoadTrainer(SetupOnlyTrainer):
    config: LoadConfig

    def pre_configure(self) -> None:
        super().pre_configure()
        self.started = time.perf_counter()

    def configure_models(self) -> None:
        from transformers import AutoConfig, AutoModelForCausalLM

        if self.config.variant == "from_pretrained":
            with torch.device("cpu"):  # escape the meta device: every rank loads it all
                self.model = AutoModelForCausalLM.from_pretrained(self.config.pretrained,
                                                                  dtype=torch.float32)
        else:
            self.model = AutoModelForCausalLM.from_config(
                AutoConfig.from_pretrained(self.config.pretrained))

    def post_setup(self) -> None:
        self.seconds = time.perf_counter() - self.started
        super().post_setup()


def rank_main(variant: str, pretrained: str, out: str) -> None:
    """Run on each rank under torchrun: load the model and record this rank's figures."""
    # Part of the baseline for both variants: transformers imports its model code lazily,
    # which would add seconds and tens of MiB to whichever variant builds a model first.
    import transformers.models.llama.modeling_llama  # noqa: F401
    from transformers import AutoModelForCausalLM  # noqa: F401

    config = LoadConfig(
        project="bench", group="hf_load", experiment=variant, variant=variant,
        pretrained=Path(pretrained),
        init_weights_from=Path(pretrained) if variant == "init_weights_from" else None,
        device_parameters=DeviceParameters.FSDP(),
        training_parameters=TrainingParameters(n_epochs=1, train_batch_size=1, max_steps=1))
    trainer = LoadTrainer(config)
    trainer.fit()
    Path(f"{out}.rank{trainer.world.rank}").write_text(
        json.dumps([trainer.peak_above_baseline, trainer.seconds]))


def measure(size_mb: int) -> dict[str, Any]:
    """Write the checkpoint, load it both ways on 2 ranks; return per-rank figures, ratios."""
    result: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        pretrained = Path(tmp) / "pretrained"
        model_bytes = write_checkpoint(pretrained, size_mb)
        result["model_bytes"] = model_bytes
        for variant in VARIANTS:
            out = str(Path(tmp) / variant)
            command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                       "--nproc_per_node=2", "-m", "benchmarks.hf_load_memory", "--rank-main",
                       "--variant", variant, "--pretrained", str(pretrained), "--out", out]
            subprocess.run(command, check=True, capture_output=True, text=True,
                           env=child_env())
            figures = [json.loads(Path(f"{out}.rank{rank}").read_text()) for rank in (0, 1)]
            peaks = [peak for peak, _ in figures]
            result[variant] = {"peak_above_baseline_bytes": peaks,
                               "ratio_to_model": max(peaks) / model_bytes,
                               "seconds": max(seconds for _, seconds in figures)}
    result["memory_ratio"] = (result["init_weights_from"]["ratio_to_model"]
                              / result["from_pretrained"]["ratio_to_model"])
    result["time_ratio"] = (result["init_weights_from"]["seconds"]
                            / result["from_pretrained"]["seconds"])
    return result


def markdown(result: dict[str, Any]) -> list[str]:
    where = (f"loading a {result['model_bytes'] / 2**30:.2f} GiB HF checkpoint into FSDP2 "
             "on 2 ranks")
    ours, usual = result["init_weights_from"], result["from_pretrained"]
    return [f"| {where}: peak RSS per rank / model size, init_weights_from | "
            f"{ours['ratio_to_model']:.2f} ({ours['seconds']:.1f} s) |",
            f"| {where}: peak RSS per rank / model size, from_pretrained on every rank, then "
            f"fully_shard | {usual['ratio_to_model']:.2f} ({usual['seconds']:.1f} s) |",
            f"| {where}: time, init_weights_from / from_pretrained | "
            f"{result['time_ratio']:.2f} |"]


def main() -> None:
    parser = argparse.ArgumentParser(description="HF checkpoint loading memory benchmark")
    parser.add_argument("--size-mb", type=int, default=1100)
    parser.add_argument("--rank-main", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--variant", choices=VARIANTS, help=argparse.SUPPRESS)
    parser.add_argument("--pretrained", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank_main:
        rank_main(args.variant, args.pretrained, args.out)
        return
    result = measure(args.size_mb)
    print(json.dumps(result, indent=2))
    print("\n".join(markdown(result)))


if __name__ == "__main__":
    main()
