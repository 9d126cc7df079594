"""Preference optimization (DPO, IPO or SimPO) of a Hugging Face chat model against a frozen
reference model, on 2 FSDP2 ranks or one process.

    pip install -e ".[hf]"        # transformers and tokenizers (and peft for --lora)
    python examples/dpo.py
    torchrun --standalone --nproc_per_node=2 examples/dpo.py      # FSDP2 over 2 ranks
    torchrun --standalone --nproc_per_node=2 examples/dpo.py --loss ipo
    torchrun --standalone --nproc_per_node=2 examples/dpo.py --loss simpo --beta 2.0
    torchrun --standalone --nproc_per_node=2 examples/dpo.py --lora true --learning_rate 1e-2
    python examples/dpo.py --init_weights_from path/to/a/save_pretrained/directory \\
        --pairs my_pairs.jsonl --val_pairs my_val_pairs.jsonl

Nothing is downloaded. Unless ``--init_weights_from`` names a directory, the first run creates
the stand-in chat model of ``sft.py`` (a small Llama with random weights and a word-level
tokenizer whose chat template is ChatML) in ``outputs/examples/dpo/pretrained``. Unless
``--pairs`` and ``--val_pairs`` name files, it also writes two JSONL files of preference
triples as conversations (``{"prompt": [...], "chosen": [...], "rejected": [...]}``): the user
asks to copy, reverse or sort some digits; the chosen answer does it, the rejected one gives
another task's answer or a corrupted one (never the chosen answer itself).

What it shows:

- ``configure_models`` builds the policy ``model`` and a frozen ``reference``
  (``requires_grad_(False)``) from the same config, both filled from ``init_weights_from``
  (``{"model": base, "reference": reference_from or base}``) and sharded alike. The reference
  stays in eval mode, is in no optimizer, and checkpoints leave its weights out and record its
  source (``models.json``); rank 0 prints a SHA-256 of its whole weights before and after
  training, the same. ``--loss simpo`` needs no reference, so none is built; with ``--lora
  true`` the policy gets peft LoRA adapters and its base, adapters switched off, is the
  reference (no second model in memory).
- ``configure_dataloaders`` reads the triples through ``PreferenceDataset`` (rendered with the
  chat template; labels only on the answers; an answer cut to ``max_length`` tokens, the prompt
  never cut) and its ``collate``, which stacks every chosen answer, then every rejected one,
  so one forward pass of each model serves both.
- ``training_step`` runs the reference through ``forward_loss`` (no gradients) and the policy
  through ``forward_backward`` with ``dpo_loss``, ``ipo_loss`` or ``simpo_loss`` as its loss;
  it returns the loss and TRL's metrics (``rewards/chosen``, ``rewards/rejected``,
  ``rewards/margins``, ``rewards/accuracies``) as results, so they are averaged over
  micro-batches and ranks like any result, and logged (``outputs/examples/dpo/...``).
- Before training the policy is the reference: the DPO loss of every pair is ln 2 = 0.693147
  and no pair is ranked right (equal rewards). rank 0 prints the held-out pairs' loss,
  accuracy and margin after each validation, and the first and last logged training steps.

The step calls the models through ``forward_backward`` and ``forward_loss``, so it runs on one
process, DDP, FSDP2, HSDP, tensor parallelism and context parallelism (each batch padded to a
multiple of ``2 x context_parallel``); pipelines are not supported by this example (the
reference would need a schedule of its own).
"""

from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import torch
import torch.nn.functional as F
from pydantic import Field, PositiveInt, model_validator
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader
from typing_extensions import Self, override

# Run as a script, this file's directory is sys.path[0], so its sibling imports as a module.
from sft import SYSTEM, TASKS, LlamaShape, ensure_pretrained, write_atomically

from dream_trainer import DreamTrainer, DreamTrainerConfig
from dream_trainer.callbacks import CallbackCollection
from dream_trainer.configs import (CheckpointParameters, DeviceParameters, LoggingParameters,
                                   TrainingParameters, apply_cli_overrides)
from dream_trainer.data import PreferenceDataset
from dream_trainer.nn import dpo_loss, ipo_loss, sequence_log_probs, simpo_loss, split_pairs
from dream_trainer.nn.preference import IGNORE_INDEX, Metrics

OUTPUTS = Path("outputs/examples/dpo")
REWARDS = ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies")
PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


class DPOConfig(DreamTrainerConfig):
    llama: LlamaShape = Field(default_factory=LlamaShape)
    """Shape of the stand-in pretrained model (used only when it is created)."""
    pairs: Path = OUTPUTS / "pairs.jsonl"
    """JSONL of training triples; written (2000 of them) when this default is missing."""
    val_pairs: Path = OUTPUTS / "val_pairs.jsonl"
    """JSONL of held-out triples; written (200) when this default is missing."""
    max_length: PositiveInt = 64
    """At most this many tokens per prompt + answer; a longer answer is cut from its end."""
    tokenizer: Path | None = None
    """Directory of the tokenizer (with a chat template); by default the policy's weights'."""
    reference_from: Path | None = None
    """The reference model's weights; by default the policy's (``init_weights_from``)."""
    loss: Literal["dpo", "ipo", "simpo"] = "dpo"
    """The preference loss; ``simpo`` is reference-free (no reference model is built)."""
    beta: float | None = Field(default=None, gt=0)
    """The loss's beta; None: 0.1 for dpo and ipo (TRL's default), 2.0 for simpo (its
    authors')."""
    label_smoothing: float = Field(default=0.0, ge=0, lt=0.5)
    """The assumed probability that a pair's preference is flipped (dpo and simpo)."""
    simpo_gamma: float = Field(default=0.5, ge=0)
    """SimPO's target reward margin."""
    lora: bool = False
    """Train peft LoRA adapters (r=8 on every projection) instead of the whole policy, with
    the base, adapters switched off, as the reference."""
    learning_rate: float = Field(default=1e-3, gt=0)
    """AdamW learning rate (LoRA takes a larger one, about 1e-2)."""

    @model_validator(mode="after")
    def _check_loss_options(self) -> Self:
        if self.loss == "ipo" and self.label_smoothing:
            raise ValueError(f"label_smoothing={self.label_smoothing} with loss='ipo': IPO's "
                             "squared loss has no label smoothing; use --loss dpo or simpo, or "
                             "--label_smoothing 0")
        if self.reference_from is not None and not self.needs_reference_model:
            reason = "SimPO needs no reference" if self.loss == "simpo" \
                else "lora=True takes the policy's base as the reference"
            raise ValueError(f"{reason}, so reference_from={self.reference_from} would be "
                             "unused: drop it, or train DPO or IPO without --lora to use "
                             "another reference model")
        return self

    @property
    def needs_reference_model(self) -> bool:
        """Whether a separate reference model is built (not for SimPO, nor with LoRA)."""
        return self.loss != "simpo" and not self.lora

    @property
    def loss_beta(self) -> float:
        """``beta``, or the chosen loss's usual one."""
        if self.beta is not None:
            return self.beta
        return 2.0 if self.loss == "simpo" else 0.1


class DPOTrainer(DreamTrainer):
    config: DPOConfig

    def __init__(self, config: DPOConfig) -> None:
        super().__init__(config)
        from transformers import AutoTokenizer

        self.policy_source = policy_source(config)
        self.tokenizer = AutoTokenizer.from_pretrained(config.tokenizer or self.policy_source)
        self.validations: list[tuple[int, dict[str, float]]] = []
        self.checksums: list[str] = []

    @override
    def configure_models(self) -> None:
        from transformers import AutoConfig, AutoModelForCausalLM

        # Runs on the meta device: no memory, no initialization until the models are sharded.
        self.model = AutoModelForCausalLM.from_config(
            AutoConfig.from_pretrained(self.policy_source))
        if self.config.lora:
            from peft import LoraConfig, get_peft_model

            self.model = get_peft_model(self.model, LoraConfig(
                r=8, lora_alpha=16, target_modules=PROJECTIONS))
        if self.config.needs_reference_model:
            # Frozen: no trainable parameter, so eval mode, no DDP wrapper, no optimizer, and
            # checkpoints that record where its weights came from instead of the weights.
            self.reference = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(
                self.config.reference_from or self.policy_source)).requires_grad_(False)

    @override
    def apply_tensor_parallel(self, tp_mesh: DeviceMesh) -> None:
        from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                       parallelize_module)

        from dream_trainer.parallel.lora import lora_tensor_parallel_plan

        # As in sft.py: whole heads on each rank, o_proj and down_proj add them up; LoRA
        # layers' adapters follow their base layer's split.
        plan = {"self_attn.q_proj": ColwiseParallel(), "self_attn.k_proj": ColwiseParallel(),
                "self_attn.v_proj": ColwiseParallel(), "self_attn.o_proj": RowwiseParallel(),
                "mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel(),
                "mlp.down_proj": RowwiseParallel()}
        for model in self.named_models().values():
            causal_lm = model.base_model.model if model is self.model and self.config.lora \
                else model
            for layer in causal_lm.model.layers:
                parallelize_module(layer, tp_mesh, lora_tensor_parallel_plan(layer, plan))

    @override
    def configure_optimizers(self) -> None:
        trainable = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(trainable, lr=self.config.learning_rate)

    def preferences(self, path: Path) -> PreferenceDataset:
        return PreferenceDataset(path, self.tokenizer, max_length=self.config.max_length)

    @override
    def configure_dataloaders(self) -> tuple[DataLoader[Any], DataLoader[Any]]:
        params = self.config.training_parameters
        train, val = self.preferences(self.config.pairs), self.preferences(self.config.val_pairs)
        return (DataLoader(train, batch_size=params.train_batch_size, shuffle=True,
                           drop_last=True, collate_fn=train.collate),
                DataLoader(val, batch_size=params.val_batch_size, collate_fn=val.collate))

    def tokens_and_targets(self, batch: dict[str, torch.Tensor]
                           ) -> tuple[torch.Tensor, torch.Tensor]:
        """The batch's ids, and its next-token targets (-100 off the answers), padded to a
        multiple of ``2 x context_parallel`` tokens.

        The targets are shifted here, before context parallelism splits the sequences, so
        that each rank's part scores its own positions. The attention mask is not needed:
        the padding is on the right, where causal attention never looks back from a real
        token.
        """
        tokens = batch["input_ids"]
        targets = F.pad(batch["labels"][:, 1:], (0, 1), value=IGNORE_INDEX)
        extra = -tokens.size(1) % (2 * self.world.dims.cp)
        if extra:
            tokens = F.pad(tokens, (0, extra), value=self.tokenizer.pad_token_id)
            targets = F.pad(targets, (0, extra), value=IGNORE_INDEX)
        return tokens, targets

    def summed_log_probs(self, output: Any, targets: torch.Tensor) -> torch.Tensor:
        """Each row's log-probability of its answer (this rank's part of it under context
        parallelism)."""
        return sequence_log_probs(output.logits, targets, shifted=True)[0]

    def reference_log_probs(self, tokens: torch.Tensor, targets: torch.Tensor
                            ) -> torch.Tensor | None:
        """The reference's summed answer log-probs of whole sequences (``num_items=1``: the
        context-parallel parts are added up), without gradients; None for SimPO."""
        if self.config.loss == "simpo":
            return None
        if self.config.lora:
            peft_model = self.model.module if isinstance(self.model, DistributedDataParallel) \
                else self.model
            with peft_model.disable_adapter():
                return self.forward_loss(self.model, tokens, target=targets,
                                         loss_fn=self.summed_log_probs, num_items=1)
        return self.forward_loss(self.reference, tokens, target=targets,
                                 loss_fn=self.summed_log_probs, num_items=1)

    def preference_loss(self, policy: torch.Tensor, reference: torch.Tensor | None,
                        answer_tokens: torch.Tensor) -> tuple[torch.Tensor, Metrics]:
        """The configured loss of each pair, and its per-pair metrics, from the rows' summed
        log-probs (chosen rows first) and their answers' token counts."""
        config, beta = self.config, self.config.loss_beta
        chosen, rejected = split_pairs(policy)
        chosen_tokens, rejected_tokens = split_pairs(answer_tokens)
        if reference is None:
            return simpo_loss(chosen, rejected, chosen_tokens=chosen_tokens,
                              rejected_tokens=rejected_tokens, beta=beta,
                              gamma=config.simpo_gamma, label_smoothing=config.label_smoothing)
        reference_chosen, reference_rejected = split_pairs(reference)
        if config.loss == "ipo":
            return ipo_loss(chosen, rejected, reference_chosen, reference_rejected,
                            chosen_tokens=chosen_tokens, rejected_tokens=rejected_tokens,
                            beta=beta)
        return dpo_loss(chosen, rejected, reference_chosen, reference_rejected, beta=beta,
                        label_smoothing=config.label_smoothing)

    @override
    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> dict[str, Any]:
        tokens, targets = self.tokens_and_targets(batch)
        # Counted on the whole sequences, before a context-parallel split.
        answer_tokens = (targets != IGNORE_INDEX).sum(dim=1)
        reference = self.reference_log_probs(tokens, targets)
        metrics: Metrics = {}

        def loss_fn(output: Any, target: torch.Tensor) -> torch.Tensor:
            # sequence_sum: DPO's log-sigmoid needs whole sequences' log-probs (cp adds the
            # parts up, with the gradient each part's tokens are owed).
            policy = self.sequence_sum(self.summed_log_probs(output, target))
            losses, found = self.preference_loss(policy, reference, answer_tokens)
            metrics.update(found)
            return losses.mean()

        # A mean over this rank's pairs: the ranks' equal shares average to the global mean.
        loss = self.forward_backward(self.model, tokens, target=targets, loss_fn=loss_fn)
        # Means over this rank's pairs. The logs average them over micro-batches and ranks,
        # each weighted by its batch's rows (two per pair): the mean over the step's pairs.
        result = {"loss": loss, **{key: metrics[key].mean() for key in REWARDS}}
        if not self.is_accumulating_gradients:
            result["grad_norm"] = self.step(self.model, self.optimizer)
        return result

    @override
    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int
                        ) -> dict[str, Any]:
        tokens, targets = self.tokens_and_targets(batch)
        policy = self.forward_loss(self.model, tokens, target=targets,
                                   loss_fn=self.summed_log_probs, num_items=1)
        losses, metrics = self.preference_loss(policy, self.reference_log_probs(tokens, targets),
                                               (targets != IGNORE_INDEX).sum(dim=1))
        return {"val_loss": losses.mean(), "val_accuracy": metrics["rewards/accuracies"].mean(),
                "val_margin": metrics["rewards/margins"].mean()}

    @override
    def pre_fit(self) -> None:
        super().pre_fit()
        self.record_reference_checksum()
        if self.world.is_rank_zero:
            print(f"started from {self.policy_source.resolve()}", flush=True)
            print(f"loss: {self.config.loss} (beta={self.config.loss_beta}), reference: "
                  f"{self.reference_description()}", flush=True)
        self.evaluate(max_batches=self.config.training_parameters.val_steps_per_epoch)

    def record_reference_checksum(self) -> None:
        """Append the checksum of the weights the reference log-probs come from (the
        reference model's, or with LoRA the policy's frozen base); none for SimPO."""
        if self.config.loss != "simpo":
            self.checksums.append(frozen_checksum(
                self.reference if self.config.needs_reference_model else self.model))

    def reference_description(self) -> str:
        if self.config.loss == "simpo":
            return "none (SimPO is reference-free)"
        if self.config.lora:
            return "the policy's base, adapters switched off"
        return str((self.config.reference_from or self.policy_source).resolve())

    @override
    def post_val_epoch(self, result: dict[str, Any]) -> None:
        super().post_val_epoch(result)
        if not self.sanity_checking:
            values = {key: float(result[key]) for key in ("val_loss", "val_accuracy",
                                                          "val_margin")}
            self.validations.append((self.global_step, values))
            if self.world.is_rank_zero:
                print(f"step {self.global_step}: " + " ".join(
                    f"{key}={value:.6f}" for key, value in values.items()), flush=True)

    @override
    def post_fit(self) -> None:
        super().post_fit()
        self.record_reference_checksum()
        if self.checksums and self.world.is_rank_zero:
            print(f"frozen reference weights: sha256 {self.checksums[0]} before training, "
                  f"{self.checksums[-1]} after", flush=True)


def frozen_checksum(model: nn.Module) -> str:
    """SHA-256 of ``model``'s frozen parameters, whole, in float32, each preceded by its name,
    in the order of their sorted names. A collective under FSDP2 and tensor parallelism
    (every rank gathers the shards)."""
    digest = hashlib.sha256()
    for name, param in sorted(model.named_parameters()):
        if param.requires_grad:
            continue
        tensor = param.detach()
        if isinstance(tensor, DTensor):
            tensor = tensor.full_tensor()
        digest.update(name.encode())
        digest.update(tensor.float().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()


def policy_source(config: DPOConfig) -> Path:
    """The directory the policy's weights (and by default the tokenizer) come from."""
    source = config.init_weights_from
    if isinstance(source, Mapping):
        source = source["model"]
    return Path(source)


def with_sources(config: DPOConfig) -> DPOConfig:
    """``config`` with ``init_weights_from`` given per model: the policy from it, and the
    reference model (when one is built) from ``reference_from`` or the same directory. A
    mapping given by the user is kept."""
    if isinstance(config.init_weights_from, Mapping):
        return config
    base = policy_source(config)
    sources = {"model": base}
    if config.needs_reference_model:
        sources["reference"] = config.reference_from or base
    return config.model_copy(update={"init_weights_from": sources})


def preference_triple(draw: random.Random) -> dict[str, list[dict[str, str]]]:
    """A task on 2 to 12 digits (some with a system message), its correct answer, and one of
    three kinds of wrong answer, drawn alike: another task's answer, the answer with one
    digit changed, or the request echoed back (not digits only). Never the correct answer:
    where every other task gives it too (all digits equal, say), a digit is changed."""
    prompt = [{"role": "system", "content": SYSTEM}] if draw.random() < 0.3 else []
    task = draw.choice(list(TASKS))
    digits = [str(draw.randrange(10)) for _ in range(draw.randint(2, 12))]
    request = " ".join([task, *digits])
    prompt.append({"role": "user", "content": request})
    chosen = " ".join(TASKS[task](digits))
    others = {" ".join(TASKS[other](digits)) for other in TASKS if other != task} - {chosen}
    kind = draw.choice(["task", "digit", "echo"])
    if kind == "echo":
        rejected = request
    elif kind == "task" and others:
        rejected = draw.choice(sorted(others))
    else:
        changed = chosen.split()
        index = draw.randrange(len(changed))
        changed[index] = str((int(changed[index]) + draw.randint(1, 9)) % 10)
        rejected = " ".join(changed)
    return {"prompt": prompt, "chosen": [{"role": "assistant", "content": chosen}],
            "rejected": [{"role": "assistant", "content": rejected}]}


def ensure_pairs(path: Path, count: int, seed: int) -> None:
    """Write ``count`` preference triples to the JSONL file ``path`` unless it exists."""
    def write(staging: Path) -> None:
        draw = random.Random(seed)
        (staging / path.name).write_text("".join(
            json.dumps(preference_triple(draw)) + "\n" for _ in range(count)))

    write_atomically(path, write)


def default_config() -> DPOConfig:
    """The run ``torchrun --standalone --nproc_per_node=2 examples/dpo.py`` trains."""
    return DPOConfig(
        project="examples", group="dpo", experiment="llama",
        init_weights_from=OUTPUTS / "pretrained",
        device_parameters=DeviceParameters.FSDP(),
        training_parameters=TrainingParameters(
            n_epochs=2, train_steps_per_epoch=30, train_batch_size=8, val_batch_size=8,
            val_steps_per_epoch=4, gradient_clip_val=1.0),
        checkpoint_parameters=CheckpointParameters(root_dir=Path("outputs"), keep_top_k=1),
        logging_parameters=LoggingParameters(log_dir=Path("outputs"), log_every_n_steps=10),
        callbacks=CallbackCollection([]),
    )


def make_trainer(args: list[str] | None = None) -> DPOTrainer:
    """The example's trainer, with ``args`` (default: the command line) as config overrides;
    creates the stand-in pretrained model and tokenizer when ``init_weights_from`` is the
    default, and the triples when ``pairs`` or ``val_pairs`` is."""
    config = apply_cli_overrides(default_config(), args, description=__doc__)
    defaults = default_config()
    if config.init_weights_from == defaults.init_weights_from:
        ensure_pretrained(OUTPUTS / "pretrained", config.llama)
    if config.pairs == defaults.pairs:
        ensure_pairs(config.pairs, count=2000, seed=0)
    if config.val_pairs == defaults.val_pairs:
        ensure_pairs(config.val_pairs, count=200, seed=1)
    return DPOTrainer(with_sources(config))


def main() -> None:
    trainer = make_trainer()
    history = trainer.fit()
    if trainer.world.is_rank_zero:
        for row in (history.steps[0], history.steps[-1]) if history.steps else ():
            print(f"train step {int(row['step'])}: " + " ".join(
                f"{key}={row[key]:.6f}" for key in ("loss", *REWARDS)))
        (_, before), (step, after) = trainer.validations[0], trainer.validations[-1]
        print(f"held-out pairs before training: loss={before['val_loss']:.4f} accuracy="
              f"{before['val_accuracy']:.3f}; after {step} steps: loss={after['val_loss']:.4f} "
              f"accuracy={after['val_accuracy']:.3f}")
        print(f"checkpoints: {trainer.checkpoint_dir.resolve()}")


if __name__ == "__main__":
    main()
