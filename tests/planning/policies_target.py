"""The rotary GPT of ``tests/scripts/activation_policies_run.py`` (4 blocks, micro-batches of
4 sequences) as a ``dream-trainer plan`` and ``summarize`` target, for the activation
policies' estimates and measurements (docs/performance.md, "Activation memory").

    dream-trainer plan tests.planning.policies_target:make_trainer --world-size 1 \\
        --activation-policies
"""

from __future__ import annotations

from collections.abc import Sequence

from dream_trainer.configs import DeviceParameters, TrainingParameters, apply_cli_overrides
from tests.helpers.rotary_gpt import GPTConfig, RotaryGPTTrainer
from tests.scripts.activation_policies_run import BLOCKS, GLOBAL_BATCH


def make_trainer(args: Sequence[str] | None = None) -> RotaryGPTTrainer:
    return RotaryGPTTrainer(apply_cli_overrides(GPTConfig(
        project="plan", group="tests", experiment="policies", n_layers=BLOCKS,
        device_parameters=DeviceParameters(),
        training_parameters=TrainingParameters(n_epochs=1, train_batch_size=GLOBAL_BATCH)),
        args))
