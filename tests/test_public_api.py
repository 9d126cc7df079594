"""The public surface: what imports, what it pulls in, and a snapshot of it."""

from __future__ import annotations

import json
import subprocess
import sys

from dream_trainer.callbacks import HOOK_NAMES
from dream_trainer.configs import DeviceParameters, TrainingParameters
from tests.helpers.launch import REPO, child_env

SNAPSHOT = {
    "dream_trainer": ["AbstractTrainer", "AbstractTrainerConfig", "BaseTrainer",
                      "BaseTrainerConfig", "DreamTrainer", "DreamTrainerConfig", "History",
                      "StopTraining"],
    "dream_trainer.configs": ["CheckpointParameters", "ConfigModel", "apply_cli_overrides", "DeviceParameters",
                              "FaultToleranceParameters", "LoggingParameters",
                              "TrainingParameters"],
    "dream_trainer.mixins": ["CSVLoggerConfigMixin", "CSVLoggerMixin", "CheckpointConfigMixin",
                             "CheckpointMixin", "EvalConfigMixin", "EvalMixin",
                             "FaultTolerantConfigMixin", "FaultTolerantMixin",
                             "JSONLoggerConfigMixin", "JSONLoggerMixin", "LoggerMixin",
                             "SetupConfigMixin", "SetupMixin", "TensorBoardLoggerConfigMixin",
                             "TensorBoardLoggerMixin", "WandBLoggerConfigMixin",
                             "WandBLoggerMixin"],
    "dream_trainer.checkpoint": ["CheckpointError", "CheckpointInfo", "export_checkpoint",
                                 "trust_globals"],
    "dream_trainer.optim": ["warmup_decay_schedule", "weight_decay_groups"],
    "dream_trainer.parallel": ["FullTensorInit", "PipelineStages", "clip_grad_norm",
                               "find_blocks", "split_model", "stage_ids"],
    "dream_trainer.data": ["ChatDataset", "PreferenceDataset", "ResumableSampler",
                           "ShardedStream", "ValidationBatches"],
    "dream_trainer.nn": ["GroupedExperts", "MoE", "active_parameters", "dpo_loss", "ipo_loss",
                         "moe_from_hf", "moe_from_torchtitan", "replace_hf_moe_blocks",
                         "replace_torchtitan_moe_blocks", "sequence_log_probs", "simpo_loss",
                         "split_pairs"],
    "dream_trainer.weights": ["TransformedKey", "torchtitan_moe_key"],
    "dream_trainer.callbacks": ["EMA", "HOOK_NAMES", "Callback", "CallbackCollection",
                                "EarlyStopping", "GarbageCollection", "HangWatchdog",
                                "Histograms", "LRMonitor", "MediaLogger", "ModelSummary",
                                "NanGuard", "Profiler",
                                "ProgressBar", "RankZeroCallback", "ReferenceLogProbs",
                                "Throughput", "TrainerHooks", "TrainerSummary"],
    "dream_trainer.world": ["DistributedWorld", "LaunchEnvironment", "MeshAxis",
                            "MeshMismatchError", "ParallelDims"],
}

TRAINING_FIELDS = ["n_epochs", "train_batch_size", "val_batch_size",
                   "gradient_accumulation_steps", "train_steps_per_epoch", "val_steps_per_epoch",
                   "val_every_n_steps", "num_sanity_val_steps", "gradient_clip_val", "max_steps",
                   "scheduler_interval"]
DEVICE_FIELDS = ["dp_replicate", "dp_shard", "context_parallel", "context_parallel_seq_dim",
                 "context_parallel_load_balance", "tensor_parallel",
                 "pipeline_parallel", "expert_parallel", "device", "param_dtype", "reduce_dtype", "compile_model",
                 "checkpoint_activations", "activation_checkpointing", "activation_offload",
                 "cpu_offload", "init_timeout", "train_timeout",
                 "flight_recorder_entries", "detect_anomaly", "pipeline_schedule",
                 "pipeline_microbatches", "pipeline_stages_per_rank", "loss_parallel",
                 "float8_recipe", "float8_filter"]


def test_all_matches_the_snapshot() -> None:
    import importlib

    for module, names in SNAPSHOT.items():
        assert sorted(importlib.import_module(module).__all__) == sorted(names), module


def test_config_fields_match_the_snapshot() -> None:
    assert list(TrainingParameters.model_fields) == TRAINING_FIELDS
    assert list(DeviceParameters.model_fields) == DEVICE_FIELDS
    assert len(HOOK_NAMES) == 21


def test_import_pulls_in_no_optional_extra() -> None:
    code = ("import sys, json, dream_trainer, dream_trainer.mixins, dream_trainer.callbacks\n"
            "print(json.dumps(sorted(sys.modules)))")
    result = subprocess.run([sys.executable, "-c", code], env=child_env(), cwd=REPO,
                            capture_output=True, text=True, timeout=120, check=True)
    modules = set(json.loads(result.stdout))
    assert "torch" in modules  # the probe really ran the import
    for heavy in ("wandb", "torchmetrics", "lightning", "rich.progress", "rich.console",
                  "tensorboard", "torch.utils.tensorboard", "PIL", "sklearn", "transformers",
                  "torchft", "torchao", "opentelemetry", "peft"):
        assert heavy not in modules, heavy
    # Each of these takes about a second to import (DTensor pulls in sympy); they load when a
    # run first shards, checkpoints or exports, not at `import dream_trainer`.
    for lazy in ("torch.distributed.tensor", "torch.distributed.fsdp",
                 "torch.distributed.checkpoint", "sympy"):
        assert lazy not in modules, lazy
