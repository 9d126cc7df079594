"""Script: a causal GPT whose blocks end in MoE layers (load-balancing bias on) trained under
expert parallelism with tensor, pipeline, context parallelism and HSDP, several runs in one
launch; rank 0 saves what each recorded to OUT.

Every run trains the rotary GPT's recipe (``tests/scripts/context_runs.py``: 3 SGD steps of 2
accumulated micro-batches of 4 sequences of 16 tokens in all, ``num_items``, binding
clipping, then validation) with each block's feed-forward network an ``MoE`` of 4 experts,
top 2, a shared expert and the auxiliary-loss-free bias. It records the initial and final
weights and every layer's bias as full tensors by name (merged from every pipeline stage),
each step's loss, gradient norm and routing slots counted on this rank, the validation
loss and how this rank's experts are split.

Usage: moe_combos.py OUT RUN [RUN ...]   (RUN names a layout of ``LAYOUTS``)
"""

from __future__ import annotations

import sys
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from dream_trainer.configs import DeviceParameters, TrainingParameters
from dream_trainer.nn import MoE
from dream_trainer.parallel.dtensor import is_dtensor
from dream_trainer.parallel.names import canonical_name
from tests.helpers.launch import init_results_group, save_on_rank_zero
from tests.helpers.rotary_gpt import DIM, Block, GPTConfig, RotaryGPT, RotaryGPTTrainer
from tests.scripts.context_runs import ACCUMULATION, GLOBAL_BATCH, Recorder
from tests.scripts.layout_matrix import everyone

EXPERTS, TOP_K, BIAS_RATE = 4, 2, 0.05

LAYOUTS: dict[str, tuple[dict[str, Any], int]] = {
    # name: (device parameters, data-parallel degree); each on 4 ranks but "one"
    "one": ({}, 1),
    "ep2_tp2": ({"expert_parallel": 2, "dp_shard": 2, "tensor_parallel": 2}, 2),
    "ep2_pp2": ({"expert_parallel": 2, "dp_shard": 2, "pipeline_parallel": 2}, 2),
    "ep2_hsdp": ({"expert_parallel": 2, "dp_shard": 2, "dp_replicate": 2}, 4),
    "ep2_cp2": ({"expert_parallel": 2, "dp_shard": 2, "context_parallel": 2}, 2),
    # Only the second block is an MoE layer: the first pipeline stage holds none.
    "one_half": ({}, 1),
    "ep2_pp2_half": ({"expert_parallel": 2, "dp_shard": 2, "pipeline_parallel": 2}, 2),
    # No MoE layer on any stage: refused on every rank, the same message.
    "ep2_pp2_none": ({"expert_parallel": 2, "dp_shard": 2, "pipeline_parallel": 2}, 2),
}
MOE_BLOCKS = {"one_half": (1,), "ep2_pp2_half": (1,), "ep2_pp2_none": ()}
"""The blocks that end in an MoE layer, where not every block does."""


class MoEBlock(Block):
    """The rotary block with an MoE layer in place of its MLP."""

    def __init__(self) -> None:
        super().__init__()
        del self.w1, self.w2
        self.moe = MoE(DIM, DIM, EXPERTS, TOP_K, num_shared_experts=1,
                       bias_update_rate=BIAS_RATE)

    def feed_forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.moe(h)


class MoEGPT(RotaryGPT):
    def __init__(self, layers: int = 2, moe_blocks: tuple[int, ...] | None = None) -> None:
        super().__init__(layers)
        self.layers = nn.ModuleList(
            MoEBlock() if moe_blocks is None or index in moe_blocks else Block()
            for index in range(layers))


class MoEGPTTrainer(RotaryGPTTrainer):
    """Attention tensor-parallel; the MoE layers (router, experts, shared expert) whole on
    every tensor-parallel rank, their experts split by expert parallelism."""

    def configure_models(self) -> None:
        self.model = MoEGPT(self.config.n_layers, MOE_BLOCKS.get(self.config.experiment))

    def apply_tensor_parallel(self, tp_mesh: DeviceMesh) -> None:
        from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                       parallelize_module)

        plan = {"q": ColwiseParallel(), "k": ColwiseParallel(), "v": ColwiseParallel(),
                "o": RowwiseParallel()}
        for block in self.model.layers:
            if block is not None:
                parallelize_module(block, tp_mesh, plan)


class MoERecorder(Recorder):
    def __init__(self) -> None:
        super().__init__()
        self.loads: list[list[float]] = []
        """Per step, the routing slots each MoE layer of this rank counted (all experts)."""

    def pre_optimizer_step(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.loads.append([float(module.tokens_per_expert.sum()) for module in
                           self.trainer.model.modules() if isinstance(module, MoE)])

    def post_fit(self) -> None:
        super().post_fit()
        model = self.trainer.model
        biases = {canonical_name(model, name): buffer.clone()
                  for name, buffer in model.named_buffers() if name.endswith("expert_bias")}
        self.biases: dict[str, torch.Tensor] = {}
        for part in everyone(biases):
            self.biases.update(part)
        moes = [module for module in model.modules() if isinstance(module, MoE)]
        w1 = moes[0].experts.w1 if moes else None  # None: this rank's stage holds none
        self.held = {"shape": tuple(w1.to_local().shape), "mesh": w1.device_mesh.mesh_dim_names,
                     "ep_group": moes[0].ep_group is not None} if is_dtensor(w1) else None


def config(name: str) -> GPTConfig:
    layout, dp = LAYOUTS[name]
    device = DeviceParameters(device="cpu", **({"dp_replicate": 1} | layout)) if layout \
        else DeviceParameters.SINGLE_DEVICE()
    return GPTConfig(
        project="moe_combos", group="tests", experiment=name, seed=11,
        n_sequences=3 * GLOBAL_BATCH * ACCUMULATION, device_parameters=device,
        training_parameters=TrainingParameters(
            n_epochs=1, train_batch_size=GLOBAL_BATCH // dp,
            gradient_accumulation_steps=ACCUMULATION, gradient_clip_val=0.3))


def run(name: str) -> dict[str, Any]:
    trainer = MoEGPTTrainer(config(name))
    recorder = MoERecorder()
    trainer.callbacks.append(recorder)
    trainer.callbacks.attach(trainer)
    if name == "ep2_pp2_none":
        try:
            trainer.fit()
        except ValueError as error:
            return {"error": str(error)}
        return {"error": None}
    trainer.fit()
    return {"initial": recorder.initial, "weights": recorder.weights,
            "biases": recorder.biases, "losses": recorder.losses,
            "grad_norms": recorder.grad_norms, "validation": recorder.validation,
            "held": recorder.held, "loads": recorder.loads}


def main(out: str, names: list[str]) -> None:
    results = {name: run(name) for name in names}
    # Each rank's own refusal, gathered over the results group (rank 0's alone would not show
    # that every rank raised it).
    errors = [name for name in names if "error" in results[name]]
    if errors:
        init_results_group("moe_combos_errors")
        for name in errors:
            gathered: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, results[name]["error"])
            results[name] = {"errors": gathered}
        dist.destroy_process_group()
    save_on_rank_zero(results, out, "moe_combos")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
