"""Script: fine-tune tiny transformers decoders loaded with ``init_weights_from`` in several
layouts, one after another, through ``forward_backward``; save (from rank 0) the full weights
after setup and after training, gathered from every stage and shard, with the per-step losses
and the final checkpoint's directory.

Every run trains 3 optimizer steps of 8 sequences, 2 accumulated micro-batches each.

    python hf_pipeline_run.py OUT ROOT_DIR ARCH:PRETRAINED:LAYOUT [...]          (one process)
    torchrun --nproc_per_node=N hf_pipeline_run.py OUT ROOT_DIR ARCH:PRETRAINED:LAYOUT [...]
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from dream_trainer.configs import CheckpointParameters, DeviceParameters, TrainingParameters
from dream_trainer.mixins import CheckpointConfigMixin, CheckpointMixin
from tests.helpers.hf import HFConfig, HFTrainer, hf_config
from tests.helpers.launch import save_on_rank_zero
from tests.scripts.pipeline_runs import gathered

LAYOUTS = {
    "single": (DeviceParameters.SINGLE_DEVICE(), 1),
    "pp2_1f1b": (DeviceParameters(dp_replicate=1, pipeline_parallel=2,
                                  pipeline_schedule="1F1B"), 1),
    "pp2_interleaved": (DeviceParameters(dp_replicate=1, pipeline_parallel=2,
                                         pipeline_schedule="Interleaved1F1B"), 1),
    "pp2_fsdp2": (DeviceParameters(dp_replicate=1, pipeline_parallel=2, dp_shard=2), 2),
}
STEP_SAMPLES, ACCUMULATION = 8, 2
TIED = ("model.embed_tokens.weight", "lm_head.weight")


def causal_lm_loss(output: Any, tokens: torch.Tensor) -> torch.Tensor:
    """The next-token loss from the logits (a pipeline's last stage returns the logits, one
    process the model's output object)."""
    logits = getattr(output, "logits", output)
    return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), tokens[:, 1:].flatten())


class RunConfig(HFConfig, CheckpointConfigMixin):
    pass


class Run(HFTrainer):
    def training_step(self, batch: Any, batch_idx: int) -> dict[str, Any]:
        (tokens,) = batch
        loss = self.forward_backward(self.model, tokens, target=tokens, loss_fn=causal_lm_loss)
        if not self.is_accumulating_gradients:
            return {"loss": loss, "grad_norm": self.step(self.model, self.optimizer)}
        return {"loss": loss}

    def post_setup(self) -> None:
        super().post_setup()
        self.initial = gathered(dict(self.model.named_parameters()))
        self.step_losses: list[dict[str, float]] = []
        self.tied_copies: list[dict[str, torch.Tensor]] = []

    def post_train_batch(self, result: dict[str, Any], batch_idx: int) -> None:
        super().post_train_batch(result, batch_idx)
        if not self.is_accumulating_gradients:  # collectives, on every rank
            self.step_losses.append(self.reduce_step_result())
            if self.config.architecture == "llama_tied":  # each stage's copy, after the step
                self.tied_copies.append(gathered(
                    {name: param for name, param in self.model.named_parameters(
                        remove_duplicate=False) if name in TIED}))

    def post_fit(self) -> None:
        super().post_fit()
        self.final = gathered(dict(self.model.named_parameters()))


class Saved(Run, CheckpointMixin):
    """Also checkpoints (the layouts whose checkpoint the test exports)."""


SAVED = {"pp2_fsdp2"}


def run(root: str, spec: str) -> dict[str, Any]:
    architecture, pretrained, layout = spec.split(":")
    params, dp = LAYOUTS[layout]
    training = TrainingParameters(n_epochs=1, train_batch_size=STEP_SAMPLES // dp // ACCUMULATION,
                                  gradient_accumulation_steps=ACCUMULATION, max_steps=3)
    base = hf_config(architecture, device_parameters=params, training_parameters=training,
                     init_weights_from=Path(pretrained), layers=4)
    fields = {**dict(base), "experiment": f"{architecture}_{layout}"}
    trainer = Saved(RunConfig(**fields, checkpoint_parameters=CheckpointParameters(
        root_dir=root))) if layout in SAVED else Run(HFConfig(**fields))
    trainer.fit()
    return {"initial": trainer.initial, "final": trainer.final,
            "step_losses": [entry["loss"] for entry in trainer.step_losses],
            "grad_norms": [entry["grad_norm"] for entry in trainer.step_losses],
            "global_step": trainer.global_step, "model_type": type(trainer.model).__name__,
            "tied_copies": trainer.tied_copies,
            "checkpoint": (trainer.checkpoint_dir / f"step_{trainer.global_step}"
                           if isinstance(trainer, Saved) else None)}


def main(out: str, root: str, *specs: str) -> None:
    save_on_rank_zero({spec: run(root, spec) for spec in specs}, out, "hf_pipeline_run")


if __name__ == "__main__":
    main(*sys.argv[1:])
