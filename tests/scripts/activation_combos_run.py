"""Script: activation checkpointing policies and activation offload composed with what the
policy tests' layouts leave out: a pipeline (pp=2), MoE layers under expert parallelism
(ep=2 over dp_shard=2, load-balancing bias on) and float8 (emulated) under FSDP2, and offload
under tensor and context parallelism too; every run in one launch of 2 ranks; rank 0 saves
what each recorded to OUT.

A dense run trains the rotary GPT of ``activation_policies_run.py`` (4 blocks, 3 SGD steps of
4 sequences); an MoE run the GPT of ``moe_combos.py`` (2 blocks ending in MoE layers, 3 steps
of 2 accumulated micro-batches, clipping). Each records the initial and final weights as full
tensors by name (merged from every pipeline stage); an MoE run also the load counted per
step and the balancing biases.

Usage: activation_combos_run.py OUT RUN [RUN ...]   (RUN is LAYOUT:SETTING, of ``LAYOUTS``
and ``SETTINGS``)
"""

from __future__ import annotations

import sys
from typing import Any

import torch

from dream_trainer.configs import DeviceParameters, TrainingParameters
from tests.helpers.launch import save_on_rank_zero
from tests.helpers.rotary_gpt import GPTConfig
from tests.scripts.activation_policies_run import BLOCKS, GLOBAL_BATCH, STEPS, PolicyTrainer
from tests.scripts.layout_matrix import everyone
from tests.scripts.moe_combos import MoEGPTTrainer, MoERecorder
from tests.scripts.moe_combos import config as moe_config

LAYOUTS: dict[str, tuple[dict[str, Any], int]] = {
    # name: (device parameters, data-parallel degree), each on 2 ranks
    "pp2": ({"pipeline_parallel": 2}, 1),
    "ep2": ({"expert_parallel": 2, "dp_shard": 2}, 2),
    "float8": ({"dp_shard": 2, "float8_recipe": "tensorwise"}, 2),
    "tp2": ({"tensor_parallel": 2}, 1),
    "cp2": ({"context_parallel": 2}, 1),
}

SETTINGS: dict[str, dict[str, Any]] = {
    "none": {},
    "full": {"activation_checkpointing": "full"},
    "every_2nd": {"activation_checkpointing": 2},
    "selective": {"activation_checkpointing": "selective"},
    "offload": {"activation_offload": True},
    "full_offload": {"activation_checkpointing": "full", "activation_offload": True},
}


class StagesTrainer(PolicyTrainer):
    """Its weights merged from every rank, so that a pipeline run records both stages."""

    def full_weights(self) -> dict[str, torch.Tensor]:
        merged: dict[str, torch.Tensor] = {}
        for part in everyone(super().full_weights()):
            merged.update(part)
        return merged


def run_dense(layout: str, setting: str) -> dict[str, Any]:
    device, dp = LAYOUTS[layout]
    trainer = StagesTrainer(GPTConfig(
        project="combos", group="tests", experiment=f"{layout}-{setting}", n_layers=BLOCKS,
        device_parameters=DeviceParameters(dp_replicate=1, **device, **SETTINGS[setting]),
        training_parameters=TrainingParameters(n_epochs=1, train_batch_size=GLOBAL_BATCH // dp,
                                               max_steps=STEPS)))
    trainer.fit()
    return {"initial": trainer.initial, "weights": trainer.weights, "steps": trainer.global_step}


def run_moe(setting: str) -> dict[str, Any]:
    config = moe_config("ep2_pp2")  # its batch sizes and data; the layout is replaced
    device, _ = LAYOUTS["ep2"]
    trainer = MoEGPTTrainer(config.model_copy(update={
        "experiment": f"ep2-{setting}",
        "device_parameters": DeviceParameters(dp_replicate=1, **device, **SETTINGS[setting])}))
    recorder = MoERecorder()
    trainer.callbacks.append(recorder)
    trainer.callbacks.attach(trainer)
    trainer.fit()
    return {"initial": recorder.initial, "weights": recorder.weights, "loads": recorder.loads,
            "biases": recorder.biases, "steps": trainer.global_step}


def run(name: str) -> dict[str, Any]:
    layout, setting = name.split(":")
    return run_moe(setting) if layout == "ep2" else run_dense(layout, setting)


def main(out: str, names: list[str]) -> None:
    save_on_rank_zero({name: run(name) for name in names}, out, "activation_combos")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
