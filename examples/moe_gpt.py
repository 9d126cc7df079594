"""A mixture-of-experts GPT on the same byte data as char_gpt.py, with expert parallelism.

    torchrun --standalone --nproc_per_node=2 examples/moe_gpt.py
    torchrun --standalone --nproc_per_node=2 examples/moe_gpt.py \\
        --device_parameters.expert_parallel 2
    python examples/moe_gpt.py --help

Every block of char_gpt.py's model keeps its attention, and its MLP becomes a
``dream_trainer.nn.MoE`` layer: ``num_experts`` SwiGLU experts, each token routed to its
``top_k`` best-scored ones, load balanced without an auxiliary loss (DeepSeek-V3's bias, moved
after every optimizer step by the load of the whole step on every rank).

What it shows:

- The model is built on the meta device like any other; ``DeviceParameters.FSDP()`` shards
  it over every rank, experts included.
- ``--device_parameters.expert_parallel 2`` splits every layer's experts over 2 ranks
  instead: each holds ``num_experts / 2`` of them, tokens travel to their experts' ranks and
  back by all-to-all, and FSDP2 shards the rest. The degree borrows ranks from ``dp_shard``,
  so the same 2 processes run it; nothing in the trainer below changes.
- Rank 0 prints the active parameters per token (the dense weights and ``top_k`` of the
  experts of each layer) against the total, then ``step <N>: val_loss=<float>`` after
  each validation pass, starting near ln(256) = 5.55, and the balancing bias range of the
  first layer at the end.
- Checkpoints hold every expert whole, so a run with ``expert_parallel 2`` resumes with 1
  and the reverse (``--checkpoint_parameters.resume latest``).
"""

from __future__ import annotations

from pydantic import Field, PositiveFloat, PositiveInt
from typing_extensions import override

# Run as a script, this file's directory is sys.path[0], so its sibling imports as a module.
from char_gpt import CharGPT, CharGPTConfig, CharGPTTrainer, GPTParameters, run
from char_gpt import default_config as char_gpt_config

from dream_trainer.configs import apply_cli_overrides
from dream_trainer.nn import MoE, active_parameters
from dream_trainer.nn.moe import moe_layers


class MoEGPTParameters(GPTParameters):
    """The shape of the model: char_gpt's, with a mixture of experts in every block."""

    num_experts: PositiveInt = 8
    """Routed experts per layer; with expert parallelism a multiple of its degree."""
    top_k: PositiveInt = 2
    """Experts each token is sent to."""
    expert_hidden: PositiveInt = 128
    """Hidden width of each expert."""
    bias_update_rate: PositiveFloat = 1e-3
    """Step of the auxiliary-loss-free balancing bias per optimizer step."""


class MoEGPT(CharGPT):
    """``CharGPT`` whose blocks route each token through ``top_k`` of ``num_experts`` experts
    instead of one MLP."""

    def __init__(self, params: MoEGPTParameters) -> None:
        super().__init__(params)
        for block in self.blocks:
            block.mlp = MoE(params.dim, params.expert_hidden, params.num_experts, params.top_k,
                            normalize_scores=True, bias_update_rate=params.bias_update_rate)


class MoEGPTConfig(CharGPTConfig):
    gpt: MoEGPTParameters = Field(default_factory=MoEGPTParameters)
    """Model shape."""


class MoEGPTTrainer(CharGPTTrainer):
    config: MoEGPTConfig

    @override
    def configure_models(self) -> None:
        self.model = MoEGPT(self.config.gpt)

    @override
    def pre_fit(self) -> None:
        if self.world.is_rank_zero:
            gpt = self.config.gpt
            total = sum(p.shape.numel() for p in self.model.parameters())  # full shapes
            print(f"each token uses {active_parameters(self.model):,} of the {total:,} "
                  f"parameters (the dense ones and {gpt.top_k} of {gpt.num_experts} experts "
                  "per layer)", flush=True)
        super().pre_fit()

    @override
    def post_fit(self) -> None:
        super().post_fit()
        bias = next(moe_layers(self.model)).expert_bias
        if self.world.is_rank_zero:
            print(f"first layer's balancing bias: {float(bias.min()):+.4f} .. "
                  f"{float(bias.max()):+.4f}", flush=True)


def default_config() -> MoEGPTConfig:
    """char_gpt.py's run, with the MoE model."""
    base = {name: value for name, value in dict(char_gpt_config()).items() if name != "gpt"}
    return MoEGPTConfig(**{**base, "group": "moe_gpt", "experiment": "moe", "sample_length": 0})


def make_trainer(args: list[str] | None = None) -> MoEGPTTrainer:
    """The example's trainer, with ``args`` (default: the command line) as config overrides."""
    return MoEGPTTrainer(apply_cli_overrides(default_config(), args, description=__doc__))


if __name__ == "__main__":
    run(make_trainer())
