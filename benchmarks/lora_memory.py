"""Per-rank peak memory of a LoRA training step against full fine-tuning, FSDP2 on 2 ranks.

The same transformers Llama, the same batches, AdamW, two optimizer steps each: (a) full
fine-tuning (every weight trained), (b) LoRA (peft's adapters of rank ``r`` on the seven
attention and MLP projections, the base frozen, only the adapters in the optimizer). The
second step is a steady-state one: AdamW's moments, which the first step creates only at its
end, are held through its forward and backward. Each variant is its own ``torchrun`` launch of
2 ranks (peak RSS only grows within a process), both in one run of this benchmark. A rank's
figure is its peak RSS at the end of the second step above its
RSS before ``configure_models`` (torch, FSDP2, DTensor, transformers' Llama code and peft
imported, one AdamW step of a tiny peft Llama taken: see ``warm_up``), as in
``meta_init_memory``; the peak at the end of setup is reported beside it. The ranks run with
a fixed ``MALLOC_MMAP_THRESHOLD_``, as in ``training_memory``, so freed tensors leave RSS.
Linux only (``/proc/self/status``, ``ru_maxrss``).

    python -m benchmarks.lora_memory                  # a Llama of 56 M parameters
    python -m benchmarks.lora_memory --quick          # tiny: checks the harness only
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader, TensorDataset

from benchmarks.processes import REPO_ROOT, child_env, current_rss_bytes, peak_rss_bytes
from dream_trainer import BaseTrainer, BaseTrainerConfig
from dream_trainer.configs import DeviceParameters, TrainingParameters
from dream_trainer.mixins import SetupConfigMixin, SetupMixin

VARIANTS = ("full", "lora")
STEPS = 2
"""The first creates AdamW's moments; the second runs with them held."""
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@dataclass(frozen=True)
class Shape:
    """The Llama, its adapters, and the global batch (split over the 2 ranks)."""

    vocab: int = 32000
    hidden: int = 512
    intermediate: int = 1408
    layers: int = 8
    heads: int = 8
    kv_heads: int = 4
    r: int = 8
    batch: int = 4
    seq: int = 256

    def llama_config(self) -> Any:
        from transformers import LlamaConfig

        return LlamaConfig(vocab_size=self.vocab, hidden_size=self.hidden,
                           intermediate_size=self.intermediate, num_hidden_layers=self.layers,
                           num_attention_heads=self.heads, num_key_value_heads=self.kv_heads,
                           max_position_embeddings=self.seq, tie_word_embeddings=False)

    def lora_config(self) -> Any:
        from peft import LoraConfig

        return LoraConfig(r=self.r, lora_alpha=2 * self.r, lora_dropout=0.0,
                          target_modules=TARGETS)

    def params(self) -> int:
        """Parameters of the Llama (without adapters)."""
        kv = self.hidden // self.heads * self.kv_heads
        layer = (2 * self.hidden * self.hidden + 2 * self.hidden * kv
                 + 3 * self.hidden * self.intermediate + 2 * self.hidden)
        return 2 * self.vocab * self.hidden + self.hidden + self.layers * layer

    def adapter_params(self) -> int:
        """Parameters of the adapters: A (r x in) and B (out x r) per projection."""
        kv = self.hidden // self.heads * self.kv_heads
        h, m = self.hidden, self.intermediate
        per_layer = sum(in_ + out for in_, out in
                        [(h, h), (h, kv), (h, kv), (h, h), (h, m), (h, m), (m, h)])
        return self.layers * self.r * per_layer


QUICK = Shape(vocab=256, hidden=32, intermediate=64, layers=2, heads=4, kv_heads=2, r=4,
              batch=2, seq=16)


def build(shape: Shape, lora: bool) -> Any:
    """The Llama of ``shape`` (on the current device), wrapped by peft when ``lora``."""
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM(shape.llama_config())
    if not lora:
        return model
    from peft import get_peft_model

    return get_peft_model(model, shape.lora_config())


def batches(shape: Shape, ranks: int, steps: int = 1) -> DataLoader[Any]:
    """``steps`` global batches of random tokens, ``shape.batch / ranks`` per rank."""
    tokens = torch.randint(0, shape.vocab, (steps * shape.batch, shape.seq),
                           generator=torch.Generator().manual_seed(1))
    return DataLoader(TensorDataset(tokens), batch_size=shape.batch // ranks)


class MemoryConfig(BaseTrainerConfig, SetupConfigMixin):
    shape: dict[str, int]
    lora: bool


class MemoryTrainer(BaseTrainer, SetupMixin):
    """AdamW steps of the trainable parameters; RSS read before configure, after setup and
    at the end."""

    config: MemoryConfig

    def pre_configure(self) -> None:
        self.baseline = current_rss_bytes()

    def configure_models(self) -> None:
        self.model = build(Shape(**self.config.shape), self.config.lora)

    def configure_optimizers(self) -> None:
        self.optimizer = torch.optim.AdamW(
            [p for p in self.model.parameters() if p.requires_grad], lr=1e-4)

    def configure_dataloaders(self) -> tuple[DataLoader[Any], None]:
        return batches(Shape(**self.config.shape), self.world.world_size, STEPS), None

    def post_setup(self) -> None:
        self.setup_peak = peak_rss_bytes() - self.baseline

    def training_step(self, batch: Any, batch_idx: int) -> dict[str, Any]:
        (tokens,) = batch
        loss = self.model(input_ids=tokens, labels=tokens).loss
        self.backward(loss)
        self.step(self.model, self.optimizer)
        return {"loss": loss}

    def validation_step(self, batch: Any, batch_idx: int) -> dict[str, Any]:
        return {}

    def post_fit(self) -> None:
        self.step_peak = peak_rss_bytes() - self.baseline
        # Counted on the whole model (a sharded parameter's numel is its global one).
        self.trainable = sum(p.numel() for p in self.model.parameters() if p.requires_grad)


def warm_up() -> None:
    """One AdamW step of a tiny peft Llama, in both variants before their baseline: the first
    build, forward and step import torch's, transformers' and peft's code lazily (tens of
    MiB), which would count against whichever variant loads more of it."""
    model = build(QUICK, lora=True)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    tokens = torch.zeros(1, QUICK.seq, dtype=torch.long)
    model(input_ids=tokens, labels=tokens).loss.backward()
    optimizer.step()


def rank_main(variant: str, shape: Shape, out: str) -> None:
    """Run on each rank under torchrun: the steps, then write this rank's figures."""
    # Part of the baseline of both variants: what the first build and step import lazily.
    import torch.distributed.fsdp  # noqa: F401
    import torch.distributed.tensor  # noqa: F401

    warm_up()
    config = MemoryConfig(
        project="bench", group="lora_memory", experiment=variant, shape=asdict(shape),
        lora=variant == "lora", device_parameters=DeviceParameters.FSDP(),
        training_parameters=TrainingParameters(n_epochs=1, max_steps=STEPS,
                                               train_batch_size=shape.batch // 2))
    trainer = MemoryTrainer(config)
    trainer.fit()
    Path(f"{out}.rank{trainer.world.rank}").write_text(json.dumps(
        {"setup_peak": trainer.setup_peak, "step_peak": trainer.step_peak,
         "trainable": trainer.trainable}))


def launch(variant: str, shape: Shape, out: Path,
           module: str = "benchmarks.lora_memory") -> list[dict[str, int]]:
    """Run ``variant`` of the benchmark ``module`` (its ``--rank-main``) on 2 ranks; return
    each rank's figures.

    Raises:
        RuntimeError: a rank failed, with the launch's output.
    """
    env = child_env()
    # Fixed, so that every freed tensor of 128 KiB or more leaves RSS (training_memory.py):
    # a released reference model's among them (dpo_memory.py).
    env["MALLOC_MMAP_THRESHOLD_"] = str(128 * 1024)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc_per_node=2", "-m", module, "--rank-main",
               "--variant", variant, "--shape", json.dumps(asdict(shape)), "--out", str(out)]
    done = subprocess.run(command, cwd=REPO_ROOT, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed ({done.returncode}):\n"
                           f"{done.stdout}{done.stderr}")
    return [json.loads(Path(f"{out}.rank{rank}").read_text()) for rank in (0, 1)]


def measure(shape: Shape = Shape()) -> dict[str, Any]:
    """Launch both variants on 2 ranks; return per-rank peaks and the LoRA / full ratio."""
    result: dict[str, Any] = {"shape": asdict(shape), "params": shape.params(),
                              "model_bytes": 4 * shape.params()}
    with tempfile.TemporaryDirectory() as tmp:
        for variant in VARIANTS:
            ranks = launch(variant, shape, Path(tmp) / variant)
            result[variant] = {
                "peak_above_baseline_bytes": [rank["step_peak"] for rank in ranks],
                "setup_peak_above_baseline_bytes": [rank["setup_peak"] for rank in ranks],
                "trainable_params": ranks[0]["trainable"]}
    result["ratio"] = (max(result["lora"]["peak_above_baseline_bytes"])
                       / max(result["full"]["peak_above_baseline_bytes"]))
    return result


def markdown(result: dict[str, Any]) -> list[str]:
    """Table rows ``| what | figure |`` for the benchmark report."""
    shape = result["shape"]
    where = (f"steady-state AdamW step of a Llama of {result['params']:,} parameters, FSDP2 on "
             f"2 ranks, batch {shape['batch']}x{shape['seq']}")
    rows = []
    for variant, label in (("full", "full fine-tuning"),
                           ("lora", f"LoRA r={shape['r']}")):
        peak = max(result[variant]["peak_above_baseline_bytes"]) / 2**20
        rows.append(f"| {where}: peak RSS per rank above baseline, {label} | {peak:.0f} MiB |")
    rows.append(f"| {where}: peak per rank, LoRA / full fine-tuning | {result['ratio']:.2f} |")
    return rows


def run_cli(description: str, variants: Sequence[str],
            rank_main: Callable[[Any, Shape, str], None],
            measure: Callable[[Shape], dict[str, Any]],
            markdown: Callable[[dict[str, Any]], list[str]]) -> None:
    """The command line of a benchmark that launches one process group per variant: measure
    and print, or (``--rank-main``, as ``launch`` calls it) be one rank of a variant."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--quick", action="store_true", help="a tiny model: checks the harness")
    parser.add_argument("--rank-main", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--variant", choices=variants, help=argparse.SUPPRESS)
    parser.add_argument("--shape", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank_main:
        rank_main(args.variant, Shape(**json.loads(args.shape)), args.out)
        return
    result = measure(QUICK if args.quick else Shape())
    print(json.dumps(result, indent=2))
    print("\n".join(["", "| what | figure |", "|---|---|", *markdown(result)]))


def main() -> None:
    run_cli("LoRA vs full fine-tuning peak memory", VARIANTS, rank_main, measure, markdown)


if __name__ == "__main__":
    main()
