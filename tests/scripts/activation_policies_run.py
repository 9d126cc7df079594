"""Script: the rotary GPT (4 blocks) trained 3 SGD steps under each activation checkpointing
policy (``POLICIES``), on each layout named, all in one launch; rank 0 saves what each run
recorded to OUT: the initial and final weights as full tensors by name, the class of each block, the
calls of the user policy, and on one process the bytes the first step kept for backward.

Usage: activation_policies_run.py OUT LAYOUT [LAYOUT ...]   (LAYOUT names one of ``LAYOUTS``)
"""

from __future__ import annotations

import sys
from collections import Counter
from typing import Any

import torch
from torch.utils.checkpoint import CheckpointPolicy

from dream_trainer.configs import DeviceParameters, TrainingParameters
from dream_trainer.parallel.names import canonical_name
from tests.helpers.launch import save_on_rank_zero
from tests.helpers.rotary_gpt import IGNORE, GPTConfig, RotaryGPTTrainer, summed_loss, targets_of
from tests.helpers.saved_activations import saved_activation_bytes
from tests.scripts.layout_matrix import full

GLOBAL_BATCH, STEPS, BLOCKS = 4, 3, 4

LAYOUTS: dict[str, tuple[dict[str, Any], int]] = {
    # name: (device parameters, data-parallel degree)
    "one": ({}, 1),
    "fsdp2": ({"dp_shard": 2}, 2),
    "tp2": ({"tensor_parallel": 2}, 1),
    "cp2": ({"context_parallel": 2}, 1),
}

USER_POLICY_CALLS: Counter[bool] = Counter()
"""Calls of ``keep_attention`` by ``ctx.is_recompute``."""


def keep_attention(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    """A user's policy: keep the attention kernels' outputs, recompute everything else."""
    USER_POLICY_CALLS[ctx.is_recompute] += 1
    if "scaled_dot_product" in str(op):
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


POLICIES: dict[str, Any] = {"none": None, "full": "full", "every_2nd": 2,
                            "selective": "selective", "user": keep_attention}


class PolicyTrainer(RotaryGPTTrainer):
    """On one process, measures what the first step's forward keeps for backward (the
    step written out, as ``forward_backward`` runs forward and backward in one call)."""

    saved: Any = None

    def training_step(self, batch: Any, batch_idx: int) -> dict[str, Any]:
        if batch_idx or self.world.world_size > 1:
            return super().training_step(batch, batch_idx)
        (tokens,) = batch
        targets = targets_of(tokens)
        count = (targets != IGNORE).sum()
        self.saved, loss = saved_activation_bytes(
            lambda: summed_loss(self.model(tokens[:, :-1]), targets),
            [*self.model.parameters(), *self.model.buffers()])
        self.backward(loss, num_items=count)
        return {"loss": loss, "grad_norm": self.step(self.model, self.optimizer)}

    def post_setup(self) -> None:
        self.initial = self.full_weights()

    def post_fit(self) -> None:
        self.weights = self.full_weights()

    def full_weights(self) -> dict[str, torch.Tensor]:
        """Every weight as a full tensor by name (a collective on a sharded layout)."""
        return {canonical_name(self.model, key): full(param)
                for key, param in self.model.named_parameters()}


def run(layout: str, policy: str) -> dict[str, Any]:
    device, dp = LAYOUTS[layout]
    USER_POLICY_CALLS.clear()
    trainer = PolicyTrainer(GPTConfig(
        project="policies", group="tests", experiment=f"{layout}-{policy}", n_layers=BLOCKS,
        device_parameters=DeviceParameters(activation_checkpointing=POLICIES[policy], **device),
        training_parameters=TrainingParameters(n_epochs=1, train_batch_size=GLOBAL_BATCH // dp,
                                               max_steps=STEPS)))
    trainer.fit()
    return {"initial": trainer.initial, "weights": trainer.weights, "steps": trainer.global_step,
            "blocks": [type(block).__name__ for block in trainer.model.layers],
            "user_policy_calls": dict(USER_POLICY_CALLS), "saved": trainer.saved}


def main(out: str, layouts: list[str]) -> None:
    save_on_rank_zero({(layout, policy): run(layout, policy)
                       for layout in layouts for policy in POLICIES}, out, "policies")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
