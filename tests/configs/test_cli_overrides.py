"""apply_cli_overrides: command-line values over a script's config, validated by pydantic."""

from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError

from dream_trainer import BaseTrainerConfig
from dream_trainer.configs import DeviceParameters, TrainingParameters, apply_cli_overrides
from dream_trainer.mixins import SetupConfigMixin
from dream_trainer.world import MeshMismatchError, ParallelDims


class ScriptConfig(BaseTrainerConfig, SetupConfigMixin):
    learning_rate: float = 3e-3
    """Peak learning rate of AdamW."""


def script_config() -> ScriptConfig:
    return ScriptConfig(project="p", group="g", experiment="e", seed=7,
                        training_parameters=TrainingParameters(n_epochs=20, train_batch_size=32,
                                                               gradient_accumulation_steps=2))


def test_named_fields_change_and_the_rest_keep_the_scripts_values() -> None:
    base = script_config()
    config = apply_cli_overrides(base, ["--training_parameters.n_epochs", "3",
                                        "--learning_rate", "0.1",
                                        "--device_parameters.param_dtype", "bfloat16"])
    assert type(config) is ScriptConfig
    assert config.training_parameters.n_epochs == 3
    assert config.learning_rate == 0.1
    assert config.device_parameters.param_dtype == torch.bfloat16
    # Untouched fields, nested or not, keep what the script set, not the class defaults.
    assert config.training_parameters.train_batch_size == 32
    assert config.training_parameters.gradient_accumulation_steps == 2
    assert (config.seed, config.project) == (7, "p")
    assert base.training_parameters.n_epochs == 20  # the script's object is not modified


def test_no_arguments_gives_an_equal_copy() -> None:
    base = script_config()
    config = apply_cli_overrides(base, [])
    assert config is not base
    assert config.model_dump(exclude={"callbacks"}) == base.model_dump(exclude={"callbacks"})


def test_a_nested_model_given_whole_as_json() -> None:
    config = apply_cli_overrides(script_config(), [
        "--training_parameters", '{"n_epochs": 2, "train_batch_size": 4}'])
    assert (config.training_parameters.n_epochs, config.training_parameters.train_batch_size) \
        == (2, 4)
    assert config.training_parameters.gradient_accumulation_steps == 2


@pytest.mark.parametrize(("args", "field"), [
    (["--training_parameters.n_epochs", "0"], "training_parameters.n_epochs"),
    (["--training_parameters.n_epochs", "three"], "training_parameters.n_epochs"),
    (["--learning_rate", "fast"], "learning_rate"),
    (["--device_parameters.dp_shard", "-2"], "device_parameters.dp_shard"),
])
def test_a_bad_value_is_pydantics_error_naming_the_field(args: list[str], field: str) -> None:
    with pytest.raises(ValidationError) as error:
        apply_cli_overrides(script_config(), args)
    assert field in str(error.value)


def test_an_unknown_field_exits_with_argparses_message(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as exit_:
        apply_cli_overrides(script_config(), ["--training_parameters.n_epoch", "3"], prog="train")
    assert exit_.value.code == 2
    assert "unrecognized arguments: --training_parameters.n_epoch 3" in capsys.readouterr().err


def test_help_lists_every_field_with_its_description_and_the_scripts_value(
        capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as exit_:
        apply_cli_overrides(script_config(), ["--help"], prog="train", description="Train it.")
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: train") and "Train it." in out
    for name in TrainingParameters.model_fields:
        assert f"--training_parameters.{name}" in out
    assert "Peak learning rate of AdamW." in out
    # argparse rewraps the help text: compare it with its whitespace folded.
    folded = " ".join(out.split())
    assert ("Number of passes over the training data; ``None`` trains until ``max_steps`` (a "
            "stream needs no epochs). (default: 20)") in folded
    assert "Micro-batch size per rank. (default: 32)" in out


@pytest.mark.parametrize("args", [
    ["--device_parameters.pipeline_parallel", "2"],
    ["--device_parameters", '{"pipeline_parallel": 2}'],
])
def test_a_pipeline_asked_for_on_the_command_line_means_what_it_means_in_python(
        args: list[str]) -> None:
    cli = apply_cli_overrides(script_config(), args).device_parameters
    python = DeviceParameters(pipeline_parallel=2)
    # The default config's derived dp_replicate="auto" is not taken for a choice: the
    # pipeline's spare ranks shard its stages either way (DDP cannot wrap them).
    assert (cli.dp_replicate, cli.dp_shard) == (python.dp_replicate, python.dp_shard) \
        == (1, "auto")
    assert cli.model_fields_set == python.model_fields_set == {"pipeline_parallel"}
    dims = ParallelDims.resolve(cli, world_size=4)
    assert dims == ParallelDims.resolve(python, world_size=4)
    assert (dims.pp, dims.dp_replicate, dims.dp_shard) == (2, 1, 2)


def test_a_layout_the_script_chose_stays_chosen_under_an_override() -> None:
    # DDP named in the script is a choice: with a pipeline added it is refused as the same
    # config written in Python is.
    base = script_config().model_copy(update={"device_parameters": DeviceParameters.DDP()})
    cli = apply_cli_overrides(base, ["--device_parameters.pipeline_parallel", "2"])
    python = DeviceParameters.DDP(pipeline_parallel=2)
    assert (cli.device_parameters.dp_replicate, cli.device_parameters.dp_shard) \
        == (python.dp_replicate, python.dp_shard) == ("auto", 1)
    for params in (cli.device_parameters, python):
        with pytest.raises(MeshMismatchError, match=r"would wrap pipeline stages in DDP.* "
                                                    r"\(dp_replicate='auto' is 2 on 4 ranks\)"):
            ParallelDims.resolve(params, world_size=4)
