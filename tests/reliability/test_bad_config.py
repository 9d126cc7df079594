"""Bad configuration: every case fails early with an error naming the field and the fix.

Each row is (config class, keyword arguments, text the error must contain). Where the mistake
can be seen from the config alone it is a pydantic ValidationError at construction, before
any process group or model exists.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
import torch
from pydantic import BaseModel, ValidationError

from dream_trainer.callbacks import Callback
from dream_trainer.configs import (CheckpointParameters, DeviceParameters, LoggingParameters,
                                   TrainingParameters)
from dream_trainer.mixins import WandBLoggerConfigMixin
from tests.helpers.toy import ToyConfig


class Typo(Callback):
    def post_trian_batch(self, result: Any, batch_idx: int) -> None:
        pass


TRAINING = {"n_epochs": 1, "train_batch_size": 4}
IDENTITY = {"project": "p", "group": "g", "experiment": "e", "training_parameters": TRAINING}

CASES: list[tuple[type[BaseModel], dict[str, Any], str]] = [
    # Wrong types.
    (TrainingParameters, {**TRAINING, "n_epochs": "ten"}, "n_epochs"),
    (TrainingParameters, {**TRAINING, "train_batch_size": 3.5}, "train_batch_size"),
    (TrainingParameters, {**TRAINING, "gradient_clip_val": "none"}, "gradient_clip_val"),
    (DeviceParameters, {"compile_model": "maybe"}, "compile_model"),
    (DeviceParameters, {"init_timeout": "soon"}, "init_timeout"),
    (CheckpointParameters, {"every_n_steps": "often"}, "every_n_steps"),
    (LoggingParameters, {"enabled": "sometimes"}, "enabled"),
    # Negative or zero counts.
    (TrainingParameters, {**TRAINING, "n_epochs": -1}, "n_epochs"),
    (TrainingParameters, {**TRAINING, "n_epochs": 0}, "n_epochs"),
    (TrainingParameters, {**TRAINING, "n_epochs": None}, "max_steps must be set"),
    (TrainingParameters, {**TRAINING, "train_batch_size": 0}, "train_batch_size"),
    (TrainingParameters, {**TRAINING, "val_batch_size": 0}, "val_batch_size"),
    (TrainingParameters, {**TRAINING, "gradient_accumulation_steps": 0}, "gradient_accumulation_steps"),
    (TrainingParameters, {**TRAINING, "train_steps_per_epoch": -3}, "train_steps_per_epoch"),
    (TrainingParameters, {**TRAINING, "val_steps_per_epoch": 0}, "val_steps_per_epoch"),
    (TrainingParameters, {**TRAINING, "val_every_n_steps": 0}, "val_every_n_steps"),
    (TrainingParameters, {**TRAINING, "num_sanity_val_steps": -1}, "num_sanity_val_steps"),
    (TrainingParameters, {**TRAINING, "gradient_clip_val": -1.0}, "gradient_clip_val"),
    (TrainingParameters, {**TRAINING, "max_steps": 0}, "max_steps"),
    (DeviceParameters, {"dp_shard": 0}, "dp_shard"),
    (DeviceParameters, {"tensor_parallel": -2}, "tensor_parallel"),
    (DeviceParameters, {"train_timeout": timedelta(0)}, "must be positive"),
    (CheckpointParameters, {"keep_top_k": 0}, "keep_top_k"),
    (CheckpointParameters, {"every_n_epochs": -1}, "every_n_epochs"),
    (LoggingParameters, {"log_every_n_steps": 0}, "log_every_n_steps"),
    # Unknown values.
    (DeviceParameters, {"param_dtype": "int8"}, "unknown dtype 'int8': use one of"),
    (DeviceParameters, {"reduce_dtype": torch.float64}, "unknown dtype"),
    (DeviceParameters, {"device": "tpu"}, "device"),
    (CheckpointParameters, {"mode": "lowest"}, "mode"),
    (WandBLoggerConfigMixin, {"wandb_mode": "cloud"}, "wandb_mode"),
    # Mesh degrees.
    (DeviceParameters, {"dp_shard": "auto", "tensor_parallel": "auto"}, "at most one mesh degree can be 'auto'"),
    (DeviceParameters, {"dp_replicate": "auto", "dp_shard": "auto"}, "dp_replicate and dp_shard"),
    (DeviceParameters, {"context_parallel": 4, "dp_shard": 2, "expert_parallel": 2},
     "expert_parallel=2 with context_parallel=4: expert parallelism borrows every "
     "context-parallel rank"),
    (DeviceParameters, {"pipeline_parallel": 2, "pipeline_schedule": "ZBVZeroBubble",
                        "pipeline_stages_per_rank": 3}, "set pipeline_stages_per_rank=2"),
    # Incompatible options.
    (DeviceParameters, {"cpu_offload": True}, "cpu_offload=True needs FSDP2 sharding: set dp_shard > 1"),
    (CheckpointParameters, {"load_weights_only": True}, "load_weights_only=True needs resume"),
    (ToyConfig, {**IDENTITY, "device_parameters": {"pipeline_parallel": 2},
                 "training_parameters": {"n_epochs": 1, "train_batch_size": 3}},
     "training_parameters.train_batch_size=3 does not split into "
     "device_parameters.pipeline_microbatches=2"),
    (ToyConfig, {**IDENTITY, "device_parameters": {"pipeline_parallel": 2,
                                                   "pipeline_microbatches": 4},
                 "training_parameters": {**TRAINING, "val_batch_size": 6}},
     "training_parameters.val_batch_size=6 does not split into"),
    (CheckpointParameters, {"keep_top_k": 2, "every_n_epochs": None}, "keep_top_k is set but no cadence is"),
    # Misspelled fields and bad callbacks.
    (TrainingParameters, {**TRAINING, "epochs": 3}, "epochs"),
    (DeviceParameters, {"tensor_paralel": 2}, "tensor_paralel"),
    (ToyConfig, {**IDENTITY, "callbacks": [Typo()]}, "did you mean 'post_train_batch'"),
    (ToyConfig, {**IDENTITY, "callbacks": ["ProgressBar"]}, "is not a Callback instance"),
    (ToyConfig, {**IDENTITY, "project": ""}, "project"),
    (ToyConfig, {**IDENTITY, "seed": "random"}, "seed"),
]


@pytest.mark.parametrize(("model", "kwargs", "message"), CASES,
                         ids=[f"{m.__name__}-{i}" for i, (m, _, _) in enumerate(CASES)])
def test_bad_configuration_is_a_validation_error(model: type[BaseModel], kwargs: dict[str, Any],
                                                 message: str) -> None:
    with pytest.raises(ValidationError) as info:
        model(**kwargs)
    assert message in str(info.value)


def test_the_table_covers_at_least_30_cases() -> None:
    assert len(CASES) >= 30
