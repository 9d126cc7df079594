"""Config validation: every invalid value is a ValidationError naming the field."""

from __future__ import annotations

import re
from datetime import timedelta
from typing import Any

import pytest
import torch
from pydantic import ValidationError

from dream_trainer import BaseTrainerConfig
from dream_trainer.callbacks import Callback, CallbackCollection
from dream_trainer.configs import DeviceParameters, TrainingParameters
from dream_trainer.mixins import SetupConfigMixin
from dream_trainer.world import MeshMismatchError, ParallelDims


class MyConfig(BaseTrainerConfig, SetupConfigMixin):
    learning_rate: float = 1e-3


def make_config(**training: Any) -> MyConfig:
    return MyConfig(project="p", group="g", experiment="e",
                    training_parameters=TrainingParameters(
                        **{"n_epochs": 1, "train_batch_size": 4, **training}))


def test_contract_example_composes_and_defaults() -> None:
    config = MyConfig(project="mnist", group="baseline", experiment="run-001",
                      training_parameters=TrainingParameters(n_epochs=10, train_batch_size=32,
                                                             gradient_accumulation_steps=4))
    assert config.learning_rate == 1e-3
    assert config.seed == 42
    tp = config.training_parameters
    assert (tp.val_batch_size, tp.gradient_accumulation_steps, tp.num_sanity_val_steps) == (32, 4, 0)
    assert tp.train_steps_per_epoch is None and tp.max_steps is None
    dp = config.device_parameters
    assert dp.dp_replicate == "auto" and dp.dp_shard == 1 and dp.tensor_parallel == 1
    assert dp.param_dtype is torch.float32 and dp.reduce_dtype is torch.float32
    assert not (dp.compile_model or dp.checkpoint_activations or dp.cpu_offload)
    assert isinstance(config.callbacks, CallbackCollection) and len(config.callbacks) == 0


@pytest.mark.parametrize(("kwargs", "field"), [
    ({"n_epochs": -1}, "n_epochs"),
    ({"n_epochs": 0}, "n_epochs"),
    ({"train_batch_size": 0}, "train_batch_size"),
    ({"val_batch_size": -2}, "val_batch_size"),
    ({"gradient_accumulation_steps": 0}, "gradient_accumulation_steps"),
    ({"train_steps_per_epoch": 0}, "train_steps_per_epoch"),
    ({"val_every_n_steps": -5}, "val_every_n_steps"),
    ({"num_sanity_val_steps": -1}, "num_sanity_val_steps"),
    ({"gradient_clip_val": 0.0}, "gradient_clip_val"),
    ({"max_steps": 0}, "max_steps"),
    ({"n_epochs": "many"}, "n_epochs"),
    ({"n_epoch": 3}, "n_epoch"),
])
def test_invalid_training_parameters_name_the_field(kwargs: dict[str, Any], field: str) -> None:
    with pytest.raises(ValidationError) as info:
        TrainingParameters(**{"n_epochs": 1, "train_batch_size": 4, **kwargs})
    assert field in {str(loc) for error in info.value.errors() for loc in error["loc"]}


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"dp_shard": "auto", "tensor_parallel": "auto"}, "at most one mesh degree can be 'auto'"),
    ({"dp_replicate": "auto", "dp_shard": "auto"}, "dp_replicate and dp_shard"),
    ({"param_dtype": "int8"}, "unknown dtype 'int8'"),
    ({"reduce_dtype": torch.int32}, "unknown dtype"),
    ({"dp_replicate": 0}, "greater than 0"),
    ({"tensor_parallel": -2}, "greater than 0"),
    ({"context_parallel": 4, "dp_shard": 2, "expert_parallel": 2},
     "expert_parallel=2 with context_parallel=4: expert parallelism borrows every "
     "context-parallel rank"),
    ({"pipeline_parallel": 2, "pipeline_schedule": "GPipe", "pipeline_stages_per_rank": 2},
     "pipeline_schedule='GPipe' runs one stage per rank but pipeline_stages_per_rank=2"),
    ({"pipeline_parallel": 2, "pipeline_schedule": "DualPipeV", "pipeline_stages_per_rank": 1},
     "pipeline_schedule='DualPipeV' places exactly 2 stages per rank in a V"),
    ({"pipeline_parallel": 4, "pipeline_microbatches": 3},
     "pipeline_microbatches=3 < 4 stages (pipeline_parallel=4 x pipeline_stages_per_rank=1)"),
    ({"pipeline_parallel": 4, "pipeline_schedule": "Interleaved1F1B", "pipeline_microbatches": 9},
     "pipeline_microbatches=9 is not a multiple of its 2 rounds"),
    ({"pipeline_parallel": 2, "pipeline_schedule": "Looped"}, "pipeline_schedule"),
    ({"pipeline_parallel": 2, "param_dtype": "fp16"}, "cannot run with param_dtype=float16"),
    ({"loss_parallel": True}, "loss_parallel=True computes the loss over vocabulary-sharded"),
    ({"pipeline_parallel": 2, "dp_replicate": 2},
     "would wrap pipeline stages in DDP, which torch's pipelining cannot run"),
    ({"cpu_offload": True}, "cpu_offload=True needs FSDP2 sharding"),
    ({"device": "tpu"}, "device"),
    ({"init_timeout": timedelta(seconds=-1)}, "must be positive"),
    ({"dp_sharding": 2}, "dp_sharding"),
])
def test_invalid_device_parameters_explain_the_fix(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValidationError) as info:
        DeviceParameters(**kwargs)
    assert message in str(info.value)


def test_dtype_names_and_objects_parse_and_serialize_by_name() -> None:
    params = DeviceParameters(param_dtype="bf16", reduce_dtype=torch.float16)
    assert params.param_dtype is torch.bfloat16 and params.reduce_dtype is torch.float16
    dumped = params.model_dump(mode="json")
    assert dumped["param_dtype"] == "bfloat16" and dumped["reduce_dtype"] == "float16"
    assert DeviceParameters.model_validate_json(params.model_dump_json()) == params


def test_factories_describe_each_strategy() -> None:
    assert DeviceParameters.SINGLE_DEVICE().dp_replicate == 1
    assert DeviceParameters.DDP().dp_replicate == "auto"
    fsdp = DeviceParameters.FSDP()
    assert (fsdp.dp_replicate, fsdp.dp_shard) == (1, "auto")
    hsdp = DeviceParameters.HSDP(dp_shard=4)
    assert (hsdp.dp_replicate, hsdp.dp_shard) == ("auto", 4)
    assert DeviceParameters.DDP(param_dtype="bf16").param_dtype is torch.bfloat16
    # Asking for one auto degree leaves dp_replicate fixed at 1 instead of clashing.
    assert DeviceParameters(tensor_parallel="auto").dp_replicate == 1


def test_a_pipeline_shards_its_spare_ranks_by_default() -> None:
    # DDP cannot wrap pipeline stages, so the data-parallel default becomes FSDP2.
    pipeline = DeviceParameters(pipeline_parallel=2, tensor_parallel=2)
    assert (pipeline.dp_replicate, pipeline.dp_shard) == (1, "auto")
    hsdp = DeviceParameters.HSDP(dp_shard=2, pipeline_parallel=2)
    assert (hsdp.dp_replicate, hsdp.dp_shard) == ("auto", 2)
    assert DeviceParameters(pipeline_parallel=2, dp_shard=2).dp_replicate == "auto"
    defaults = DeviceParameters(pipeline_parallel=2)
    assert (defaults.pipeline_schedule, defaults.pipeline_microbatches,
            defaults.pipeline_stages_per_rank, defaults.loss_parallel) == ("1F1B", None, None,
                                                                           False)


def test_val_batch_size_defaults_to_train_batch_size() -> None:
    assert TrainingParameters(n_epochs=1, train_batch_size=7).val_batch_size == 7
    assert TrainingParameters(n_epochs=1, train_batch_size=7, val_batch_size=3).val_batch_size == 3


def test_run_identity_is_required_and_non_empty() -> None:
    with pytest.raises(ValidationError, match="experiment"):
        MyConfig(project="p", group="g",
                 training_parameters=TrainingParameters(n_epochs=1, train_batch_size=1))
    with pytest.raises(ValidationError, match="project"):
        MyConfig(project="", group="g", experiment="e",
                 training_parameters=TrainingParameters(n_epochs=1, train_batch_size=1))


def test_callbacks_accept_a_list_and_reject_other_objects() -> None:
    class Recorder(Callback):
        pass

    config = make_config()
    config2 = MyConfig(**{**config.model_dump(exclude={"callbacks"}),
                          "callbacks": [Recorder()]})
    assert isinstance(config2.callbacks, CallbackCollection) and len(config2.callbacks) == 1
    assert config2.model_dump(mode="json")["callbacks"] == [
        "test_callbacks_accept_a_list_and_reject_other_objects.<locals>.Recorder"]
    with pytest.raises(ValidationError, match="CallbackCollection"):
        MyConfig(**{**config.model_dump(exclude={"callbacks"}), "callbacks": "progress"})


def test_assignment_is_validated() -> None:
    config = make_config()
    with pytest.raises(ValidationError, match="n_epochs"):
        config.training_parameters.n_epochs = -3


@pytest.mark.parametrize(("fields", "message"), [
    ({"expert_parallel": 2, "dp_shard": 3}, "dp_shard must be a multiple of 2, got dp_shard=3"),
    # DDP replicas hold no dp_shard ranks to lend.
    ({"expert_parallel": 2, "dp_shard": 1, "dp_replicate": 2},
     "dp_shard must be a multiple of 2, got dp_shard=1"),
    ({"expert_parallel": 4, "dp_shard": 1, "context_parallel": 2},
     "expert_parallel=4 borrows its ranks from dp_shard (and context_parallel=2), so dp_shard "
     "must be a multiple of 2, got dp_shard=1"),
    ({"expert_parallel": 2, "dp_shard": 2, "context_parallel": 4},
     "so expert_parallel must be a multiple of 4: set it to one, or change context_parallel"),
    ({"expert_parallel": 0}, "expert_parallel"),
])
def test_expert_parallel_degrees_that_cannot_work_are_refused(fields: dict[str, Any],
                                                              message: str) -> None:
    with pytest.raises(ValidationError, match=re.escape(message)):
        DeviceParameters(**fields)


def test_expert_parallel_borrows_from_dp_shard_without_changing_the_world() -> None:
    from dream_trainer.world import ParallelDims
    from dream_trainer.world.dims import MeshAxis

    params = DeviceParameters(expert_parallel=2)
    assert (params.dp_replicate, params.dp_shard) == (1, "auto")  # every rank shards
    dims = ParallelDims.resolve(params, world_size=8)
    assert (dims.dp_shard, dims.ep, dims.efsdp, dims.world_size) == (8, 2, 4, 8)
    assert dims.mesh_axes() == [(MeshAxis.EFSDP, 4), (MeshAxis.EP, 2)]
    with pytest.raises(MeshMismatchError, match="dp_shard must be a multiple of 2"):
        ParallelDims.resolve(DeviceParameters(expert_parallel=2, dp_shard="auto"), world_size=3)


@pytest.mark.parametrize(("fixed", "auto", "world_size", "resolved"), [
    # 1F1B needs a microbatch per stage.
    ({"pipeline_parallel": 4, "pipeline_microbatches": 1},
     {"pipeline_parallel": "auto", "pipeline_microbatches": 1}, 4,
     "pipeline_parallel='auto' is 4"),
    # Interleaved microbatches run in rounds of the degree.
    ({"pipeline_parallel": 4, "pipeline_schedule": "Interleaved1F1B", "pipeline_microbatches": 9},
     {"pipeline_parallel": "auto", "pipeline_schedule": "Interleaved1F1B",
      "pipeline_microbatches": 9}, 4, "pipeline_parallel='auto' is 4"),
    ({"pipeline_parallel": 2, "param_dtype": "fp16"},
     {"pipeline_parallel": "auto", "param_dtype": "fp16"}, 2, "pipeline_parallel='auto' is 2"),
    # DDP under a pipeline, whichever degree decides it.
    ({"pipeline_parallel": 2, "dp_replicate": 2},
     {"pipeline_parallel": 2, "dp_replicate": "auto"}, 4, "dp_replicate='auto' is 2"),
    ({"pipeline_parallel": 2, "dp_replicate": 2},
     {"pipeline_parallel": 2, "dp_replicate": 2, "dp_shard": "auto"}, 4, "dp_shard='auto' is 1"),
    ({"cpu_offload": True, "dp_replicate": 2, "dp_shard": 1},
     {"cpu_offload": True, "dp_replicate": 2, "dp_shard": "auto"}, 2, "dp_shard='auto' is 1"),
    ({"loss_parallel": True, "tensor_parallel": 1},
     {"loss_parallel": True, "tensor_parallel": "auto"}, 1, "tensor_parallel='auto' is 1"),
    ({"expert_parallel": 2, "dp_shard": 1, "context_parallel": 4},
     {"expert_parallel": 2, "dp_shard": 1, "context_parallel": "auto"}, 4,
     "context_parallel='auto' is 4"),
    # (An expert_parallel that dp_shard='auto' cannot lend to is refused by the same rule, but
    # the fix differs, another world size or expert_parallel: tests/configs/
    # test_device_messages.py.)
])
def test_an_auto_degree_is_refused_what_the_fixed_degree_is_with_the_same_message(
        fixed: dict[str, Any], auto: dict[str, Any], world_size: int, resolved: str) -> None:
    with pytest.raises(ValidationError) as refused:
        DeviceParameters(**fixed)
    message = refused.value.errors()[0]["msg"].removeprefix("Value error, ")
    params = DeviceParameters(**auto)  # the config cannot know the degree yet
    # Refused where the degrees are resolved for the world size, before any process group.
    with pytest.raises(MeshMismatchError) as at_resolution:
        ParallelDims.resolve(params, world_size)
    assert str(at_resolution.value) == f"{message} ({resolved} on {world_size} ranks)"


def test_derived_data_parallel_degrees_follow_the_given_fields() -> None:
    params = DeviceParameters(pipeline_parallel=2)
    assert params.model_fields_set == {"pipeline_parallel"}  # the derived degrees are not
    params.pipeline_parallel = 1  # validated assignment derives them anew
    assert (params.dp_replicate, params.dp_shard) == ("auto", 1)
    params.pipeline_parallel = 2
    assert (params.dp_replicate, params.dp_shard) == (1, "auto")
    reread = DeviceParameters.model_validate_json(params.model_dump_json())
    assert (reread.dp_replicate, reread.dp_shard) == (1, "auto")
