"""Per-rank peak memory of a DPO step by where the reference log-probs come from, FSDP2 on 2
ranks.

The same transformers Llama as policy (``lora_memory``'s shape), the same preference pairs
(chosen and rejected in one forward pass), AdamW, two optimizer steps each, three variants:
(a) ``sharded``: a second, frozen Llama as the reference model, sharded by FSDP2 as the
policy is (the default ``apply_fully_shard``, which reshards a frozen model's root after
forward too) and run forward each step;
(b) ``precomputed``: the same reference, its log-probs computed once before the first step
by ``ReferenceLogProbs`` with ``release=True``; (c) ``base``: LoRA adapters on the policy
(only they train) and the policy's base with the adapters switched off as the reference, no
second model. Each variant is its own ``torchrun`` launch of 2 ranks (peak RSS only grows
within a process); a rank's figure is its peak RSS at the end of the second step above its
RSS before ``configure_models``, measured as in ``lora_memory``, with the same warm-up and
``MALLOC_MMAP_THRESHOLD_``. Linux only (``/proc/self/status``, ``ru_maxrss``).

    python -m benchmarks.dpo_memory                  # a Llama of 56 M parameters
    python -m benchmarks.dpo_memory --quick          # tiny: checks the harness only
"""

from __future__ import annotations

import json
import tempfile
from dataclasses import asdict
from pathlib import Path
from typing import Any, Literal

import torch
from torch.utils.data import DataLoader, TensorDataset, default_collate

from benchmarks.lora_memory import (STEPS, MemoryTrainer, Shape, build, launch, run_cli,
                                    warm_up)
from benchmarks.processes import current_rss_bytes, peak_rss_bytes
from dream_trainer import BaseTrainerConfig
from dream_trainer.callbacks import ReferenceLogProbs
from dream_trainer.configs import DeviceParameters, TrainingParameters
from dream_trainer.mixins import SetupConfigMixin
from dream_trainer.nn import dpo_loss, sequence_log_probs

Variant = Literal["sharded", "precomputed", "base"]
VARIANTS: tuple[Variant, ...] = ("sharded", "precomputed", "base")
LABELS = {"sharded": "reference model sharded", "precomputed": "reference log-probs precomputed",
          "base": "reference = adapter-free base (LoRA)"}
BETA = 0.1
IGNORE = -100


def prompt_length(seq: int) -> int:
    """The tokens of a pair's shared prompt: the first quarter of its sequences."""
    return seq // 4


def pairs(shape: Shape, steps: int = STEPS) -> TensorDataset:
    """``steps`` global batches of ``shape.batch`` pairs: ``(index, chosen, rejected)`` of
    random tokens, chosen and rejected sharing their prompt."""
    generator = torch.Generator().manual_seed(1)
    count, prompt = steps * shape.batch, prompt_length(shape.seq)
    chosen = torch.randint(0, shape.vocab, (count, shape.seq), generator=generator)
    rejected = torch.randint(0, shape.vocab, (count, shape.seq), generator=generator)
    rejected[:, :prompt] = chosen[:, :prompt]
    return TensorDataset(torch.arange(count), chosen, rejected)


def answer_targets(tokens: torch.Tensor) -> torch.Tensor:
    """Next-token targets of the answers alone: the prompt's and the last position's ignored."""
    targets = torch.cat([tokens[:, 1:], torch.full_like(tokens[:, :1], IGNORE)], 1)
    targets[:, :prompt_length(tokens.shape[1]) - 1] = IGNORE
    return targets


def summed_log_probs(output: Any, targets: torch.Tensor) -> torch.Tensor:
    """Each sequence's summed answer log-probs: the ``loss_fn`` of the reference's pass."""
    return sequence_log_probs(output.logits, targets, shifted=True)[0]


def pair_log_probs(trainer: DPOMemoryTrainer, model: Any, batch: Any) -> torch.Tensor:
    """``ReferenceLogProbs``' ``compute``: ``[pairs, 2]``, chosen then rejected."""
    _, chosen, rejected = batch
    tokens = torch.cat([chosen, rejected])
    values = trainer.forward_loss(model, tokens, target=answer_targets(tokens),
                                  loss_fn=summed_log_probs, num_items=1)
    return torch.stack([values[:len(chosen)], values[len(chosen):]], 1)


class DPOMemoryConfig(BaseTrainerConfig, SetupConfigMixin):
    shape: dict[str, int]
    variant: Variant


class DPOMemoryTrainer(MemoryTrainer):
    """DPO steps of the policy with AdamW; RSS read before configure, after setup, before
    the first step and at the end (the optimizer, validation and end as ``MemoryTrainer``)."""

    config: DPOMemoryConfig  # type: ignore[assignment]

    def pre_configure(self) -> None:
        super().pre_configure()
        # Given in the config's callbacks by the precomputed variant.
        self.precomputed = next((callback for callback in self.callbacks
                                 if isinstance(callback, ReferenceLogProbs)), None)
        self.before_steps_peak: int | None = None

    def configure_models(self) -> None:
        shape = Shape(**self.config.shape)
        self.model = build(shape, lora=self.config.variant == "base")
        if self.config.variant != "base":
            self.reference = build(shape, lora=False).requires_grad_(False)

    def configure_dataloaders(self) -> tuple[DataLoader[Any], None]:
        shape = Shape(**self.config.shape)
        return DataLoader(pairs(shape), batch_size=shape.batch // self.world.world_size), None

    def post_setup(self) -> None:
        self.setup_peak = peak_rss_bytes() - self.baseline
        # This rank's bytes of the reference's weights: half the model's where FSDP2 shards it.
        self.reference_bytes = 0 if self.config.variant == "base" else sum(  # before release
            _local(p).numel() * p.element_size() for p in self.reference.parameters())

    def reference_log_probs(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The reference's summed answer log-probs of ``tokens``, computed now."""
        if self.config.variant == "base":
            with self.model.disable_adapter():
                return self.forward_loss(self.model, tokens, target=targets,
                                         loss_fn=summed_log_probs, num_items=1)
        return self.forward_loss(self.reference, tokens, target=targets,
                                 loss_fn=summed_log_probs, num_items=1)

    def training_step(self, batch: Any, batch_idx: int) -> dict[str, Any]:
        if self.before_steps_peak is None:  # what setup and the precomputing pass left
            self.before_steps_peak = peak_rss_bytes() - self.baseline
            self.first_step_rss = current_rss_bytes() - self.baseline
        indices, chosen, rejected = batch
        tokens = torch.cat([chosen, rejected])  # one forward pass for both answers
        targets = answer_targets(tokens)
        count = len(chosen)
        if self.precomputed is not None:
            reference = self.precomputed.lookup(indices).T.flatten()
        else:
            reference = self.reference_log_probs(tokens, targets)

        def loss_fn(output: Any, target: torch.Tensor) -> torch.Tensor:
            policy = sequence_log_probs(output.logits, target, shifted=True)[0]
            losses, _ = dpo_loss(policy[:count], policy[count:], reference[:count],
                                 reference[count:], beta=BETA)
            return losses.mean()

        loss = self.forward_backward(self.model, tokens, target=targets, loss_fn=loss_fn)
        self.step(self.model, self.optimizer)
        return {"loss": loss}


def _local(param: torch.Tensor) -> torch.Tensor:
    """A parameter's storage on this rank: a DTensor's local shard, else itself."""
    from torch.distributed.tensor import DTensor

    return param.to_local() if isinstance(param, DTensor) else param


def rank_main(variant: Variant, shape: Shape, out: str) -> None:
    """Run on each rank under torchrun: the steps, then write this rank's figures."""
    # Part of the baseline of every variant: what the first build and step import lazily.
    import torch.distributed.fsdp  # noqa: F401
    import torch.distributed.tensor  # noqa: F401

    warm_up()
    callbacks = [ReferenceLogProbs("reference", pairs(shape), default_collate, pair_log_probs,
                                   batch_size=shape.batch // 2, release=True)] \
        if variant == "precomputed" else []
    config = DPOMemoryConfig(
        project="bench", group="dpo_memory", experiment=variant, shape=asdict(shape),
        variant=variant, callbacks=callbacks, device_parameters=DeviceParameters.FSDP(),
        training_parameters=TrainingParameters(n_epochs=1, max_steps=STEPS,
                                               train_batch_size=shape.batch // 2))
    trainer = DPOMemoryTrainer(config)
    trainer.fit()
    Path(f"{out}.rank{trainer.world.rank}").write_text(json.dumps(
        {"setup_peak": trainer.setup_peak, "before_steps_peak": trainer.before_steps_peak,
         "first_step_rss": trainer.first_step_rss, "step_peak": trainer.step_peak,
         "trainable": trainer.trainable, "reference_bytes": trainer.reference_bytes}))


def measure(shape: Shape = Shape()) -> dict[str, Any]:
    """Launch the three variants on 2 ranks; return per-rank peaks and each variant's ratio
    to ``sharded`` (of the larger rank's peaks)."""
    result: dict[str, Any] = {"shape": asdict(shape), "params": shape.params(),
                              "model_bytes": 4 * shape.params()}
    with tempfile.TemporaryDirectory() as tmp:
        for variant in VARIANTS:
            ranks = launch(variant, shape, Path(tmp) / variant,
                           module="benchmarks.dpo_memory")
            result[variant] = {
                "peak_above_baseline_bytes": [rank["step_peak"] for rank in ranks],
                "setup_peak_above_baseline_bytes": [rank["setup_peak"] for rank in ranks],
                "before_steps_peak_above_baseline_bytes": [rank["before_steps_peak"]
                                                           for rank in ranks],
                "first_step_rss_above_baseline_bytes": [rank["first_step_rss"]
                                                        for rank in ranks],
                "reference_bytes_per_rank": [rank["reference_bytes"] for rank in ranks],
                "trainable_params": ranks[0]["trainable"]}
    sharded = max(result["sharded"]["peak_above_baseline_bytes"])
    result["ratio"] = {variant: max(result[variant]["peak_above_baseline_bytes"]) / sharded
                       for variant in VARIANTS[1:]}
    return result


def markdown(result: dict[str, Any]) -> list[str]:
    """Table rows ``| what | figure |`` for the benchmark report."""
    shape = result["shape"]
    where = (f"DPO step, AdamW, policy a Llama of {result['params']:,} parameters, FSDP2 on 2 "
             f"ranks, {shape['batch']} pairs x 2 x {shape['seq']} tokens")
    rows = []
    for variant in VARIANTS:
        peak = max(result[variant]["peak_above_baseline_bytes"]) / 2**20
        label = LABELS[variant].replace("LoRA", f"LoRA r={shape['r']}")
        rows.append(f"| {where}: peak RSS per rank above baseline, {label} | {peak:.0f} MiB |")
    for variant in VARIANTS[1:]:
        rows.append(f"| {where}: peak per rank, {variant} / sharded | "
                    f"{result['ratio'][variant]:.2f} |")
    return rows


def main() -> None:
    run_cli("DPO reference-model peak memory", VARIANTS, rank_main, measure, markdown)


if __name__ == "__main__":
    main()
