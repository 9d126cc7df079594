"""ModelSummary and TrainerSummary: the numbers they keep and the tables they print."""

from __future__ import annotations

import io
import json
import textwrap
from pathlib import Path

import pytest
import torch

from dream_trainer.callbacks import Callback
from dream_trainer.callbacks.summaries import ModelSummary, ModuleRow, TrainerSummary
from tests.helpers.launch import check, torchrun
from tests.helpers.toy import ToyTrainer, toy_config, toy_model


def test_counts_match_the_model_and_are_taken_on_the_meta_device() -> None:
    on_meta = []

    class Probe(Callback):
        def post_configure(self) -> None:
            on_meta.append(all(p.is_meta for p in self.trainer.model.parameters()))

    summary = ModelSummary(max_depth=1, stream=io.StringIO())
    config = toy_config(n_samples=16, callbacks=[Probe(), summary])
    ToyTrainer(config).fit()
    model = toy_model(config)
    assert on_meta == [True]
    assert summary.total_params == sum(p.numel() for p in model.parameters()) == 212
    assert (summary.trainable_params, summary.frozen_params) == (212, 0)
    assert summary.rows == [
        ModuleRow("model", "Sequential", 0, 212, 212, 0),
        ModuleRow("model.0", "Linear", 1, 8 * 16 + 16, 8 * 16 + 16, 0),
        ModuleRow("model.1", "Tanh", 1, 0, 0, 0),
        ModuleRow("model.2", "Dropout", 1, 0, 0, 0),
        ModuleRow("model.3", "Linear", 1, 16 * 4 + 4, 16 * 4 + 4, 0),
    ]
    assert summary.local_bytes == {"model": 212 * 4}


class FrozenFirstLayer(ToyTrainer):
    def configure_models(self) -> None:
        super().configure_models()
        self.model[0].requires_grad_(False)
        self.head = torch.nn.Linear(4, 2)


def test_frozen_parameters_are_counted_as_frozen_in_every_model() -> None:
    summary = ModelSummary(max_depth=0, stream=io.StringIO())
    FrozenFirstLayer(toy_config(n_samples=16, callbacks=[summary])).fit()
    assert [(row.name, row.trainable, row.frozen) for row in summary.rows] == [
        ("model", 68, 144), ("head", 10, 0)]
    assert (summary.total_params, summary.trainable_params, summary.frozen_params) == (
        222, 78, 144)


def test_model_tables_render_as_plain_text() -> None:
    stream = io.StringIO()
    FrozenFirstLayer(toy_config(n_samples=16, callbacks=[ModelSummary(stream=stream)])).fit()
    output = stream.getvalue()
    assert "\x1b" not in output and max(map(len, output.splitlines())) <= 100
    assert "model (Sequential)" in output and "head (Linear)" in output
    row = next(line for line in output.splitlines() if "model.0 " in line)
    assert [cell.strip() for cell in row.split("│")[1:6]] == ["model.0", "Linear", "144", "0",
                                                              "144"]
    assert "Total params: 222 (trainable 78, frozen 144)" in output
    assert "model: 0.00 MB (848 bytes) of parameters on rank 0 (world size 1)" in output


def test_negative_depth_is_rejected() -> None:
    with pytest.raises(ValueError, match="max_depth"):
        ModelSummary(max_depth=-1)


def test_trainer_summary_values_and_table() -> None:
    stream = io.StringIO()
    summary = TrainerSummary(stream=stream)
    ToyTrainer(toy_config(n_epochs=3, n_samples=64, gradient_accumulation_steps=2, max_steps=10,
                          callbacks=[summary])).fit()
    assert summary.summary == {
        "world_size": 1, "device": "cpu", "pipeline_parallel": 1, "dp_replicate": 1,
        "dp_shard": 1, "context_parallel": 1, "tensor_parallel": 1,
        "batch_size_per_rank": 8, "gradient_accumulation_steps": 2, "global_batch_size": 16,
        "optimizer_steps_per_epoch": 4, "n_epochs": 3, "total_optimizer_steps": 10,
        "param_dtype": "float32", "reduce_dtype": "float32",
    }
    output = stream.getvalue()
    assert "\x1b" not in output
    assert "global_batch_size" in output and "total_optimizer_steps" in output


SCRIPT = """
import json
from dream_trainer.callbacks.summaries import ModelSummary, TrainerSummary
from dream_trainer.configs import DeviceParameters
from tests.helpers.toy import ToyTrainer, toy_config

models, trainer = ModelSummary(), TrainerSummary()
ToyTrainer(toy_config(n_samples=64, device_parameters=DeviceParameters.FSDP(),
                      callbacks=[models, trainer])).fit()
if trainer.summary:
    print("RESULT", json.dumps({"bytes": models.local_bytes, "total": models.total_params,
                                "summary": trainer.summary}))
"""


@pytest.mark.distributed
def test_fsdp_sizes_are_per_rank_shards(tmp_path: Path) -> None:
    script = tmp_path / "summaries.py"
    script.write_text(textwrap.dedent(SCRIPT))
    output = check(torchrun(script)).stdout
    results = [json.loads(line.split(" ", 1)[1]) for line in output.splitlines()
               if line.startswith("RESULT")]
    assert len(results) == 1, "only rank 0 runs a RankZeroCallback"
    result = results[0]
    # Every parameter's first dimension is even, so each of the 2 ranks holds half.
    assert result["total"] == 212 and result["bytes"] == {"model": 212 * 4 // 2}
    assert {key: result["summary"][key] for key in
            ("world_size", "dp_replicate", "dp_shard", "global_batch_size")} == {
        "world_size": 2, "dp_replicate": 1, "dp_shard": 2, "global_batch_size": 16}
