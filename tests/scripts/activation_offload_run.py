"""Script: the rotary GPT (4 blocks) trained 3 SGD steps with and without activation
offloading under each checkpointing policy of ``RUNS``, on each layout named, all in one
launch; rank 0 saves what each run recorded to OUT: the initial and final weights as full
tensors by name, the class of each block and of what it wraps, and the offload counts of this rank.

Usage: activation_offload_run.py OUT LAYOUT [LAYOUT ...]   (LAYOUT: "one" or "fsdp2")
"""

from __future__ import annotations

import sys
from dataclasses import asdict
from typing import Any

from dream_trainer.configs import DeviceParameters, TrainingParameters
from dream_trainer.parallel.offload import offload_stats
from tests.helpers.launch import save_on_rank_zero
from tests.helpers.rotary_gpt import GPTConfig, RotaryGPTTrainer
from tests.scripts.activation_policies_run import GLOBAL_BATCH, STEPS, BLOCKS, PolicyTrainer

LAYOUTS: dict[str, tuple[dict[str, Any], int]] = {
    # name: (device parameters, data-parallel degree)
    "one": ({}, 1),
    "fsdp2": ({"dp_shard": 2}, 2),
}

RUNS: dict[str, tuple[Any, bool]] = {
    # name: (activation_checkpointing, activation_offload)
    "none": (None, False), "offload": (None, True),
    "full": ("full", False), "full_offload": ("full", True),
    "every_2nd": (2, False), "every_2nd_offload": (2, True),
}


def _inner(block: Any) -> str:
    wrapped = getattr(block, "_checkpoint_wrapped_module", None)
    return "" if wrapped is None else type(wrapped).__name__


def run(layout: str, name: str) -> dict[str, Any]:
    device, dp = LAYOUTS[layout]
    policy, offload = RUNS[name]
    trainer: RotaryGPTTrainer = PolicyTrainer(GPTConfig(
        project="offload", group="tests", experiment=f"{layout}-{name}", n_layers=BLOCKS,
        device_parameters=DeviceParameters(activation_checkpointing=policy,
                                           activation_offload=offload, **device),
        training_parameters=TrainingParameters(n_epochs=1, train_batch_size=GLOBAL_BATCH // dp,
                                               max_steps=STEPS)))
    trainer.fit()
    return {"initial": trainer.initial, "weights": trainer.weights, "steps": trainer.global_step,
            "blocks": [(type(block).__name__, _inner(block)) for block in trainer.model.layers],
            "stats": asdict(offload_stats(trainer.model))}


def main(out: str, layouts: list[str]) -> None:
    save_on_rank_zero({(layout, name): run(layout, name)
                       for layout in layouts for name in RUNS}, out, "offload")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
