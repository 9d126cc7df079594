"""The rotary GPT of the context-parallelism tests as a ``dream-trainer plan`` target.

    dream-trainer plan tests.planning.context_target:make_trainer --world-size 4 \\
        -- --device_parameters '{"dp_shard": 2, "context_parallel": 2}'

Sequences of ``SEQ`` positions (the rotary table's length) in micro-batches of ``BATCH``,
so that attention's keys and values are a large part of a rank's activations.
"""

from __future__ import annotations

from collections.abc import Sequence

from dream_trainer.configs import DeviceParameters, TrainingParameters, apply_cli_overrides
from tests.helpers.rotary_gpt import MAX_LEN, GPTConfig, RotaryGPTTrainer

SEQ, BATCH, SEQUENCES = MAX_LEN, 2, 64


def make_trainer(args: Sequence[str] | None = None) -> RotaryGPTTrainer:
    return RotaryGPTTrainer(apply_cli_overrides(GPTConfig(
        project="plan", group="tests", experiment="context", seq_len=SEQ,
        n_sequences=SEQUENCES, device_parameters=DeviceParameters.FSDP(),
        training_parameters=TrainingParameters(n_epochs=1, train_batch_size=BATCH)), args))
