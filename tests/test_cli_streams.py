"""``benchmark`` and ``profile`` on the data guide's stream trainers (issue #35).

The trainers are docs/data.md's: ``StreamTrainer`` reads an endless ``Counter`` with
``n_epochs=None`` and ``max_steps``, ``PackedStreamTrainer`` a packed ``ShardedStream``
through torchdata's ``StatefulDataLoader``. Each command asks for more optimizer steps than
the configured schedule has, so it must replace that schedule without breaking the stream's.
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

from dream_trainer.cli import main

TRAINERS = textwrap.dedent('''
    import torch
    import torch.nn.functional as F
    from torch import nn
    from torch.utils.data import IterableDataset
    from torchdata.stateful_dataloader import StatefulDataLoader

    from dream_trainer import BaseTrainer, BaseTrainerConfig
    from dream_trainer.configs import TrainingParameters, apply_cli_overrides
    from dream_trainer.data import ShardedStream
    from dream_trainer.mixins import SetupConfigMixin, SetupMixin


    class Counter(IterableDataset):
        def __init__(self, rank, ranks):
            self.rank, self.ranks, self.position = rank, ranks, 0

        def __iter__(self):
            while True:
                i = self.position * self.ranks + self.rank
                self.position += 1
                yield torch.tensor([float(i)]), torch.tensor([2.0 * i])

        def state_dict(self):
            return {"position": self.position}

        def load_state_dict(self, state):
            self.position = state["position"]


    class StreamConfig(BaseTrainerConfig, SetupConfigMixin):
        num_workers: int = 0


    class StreamTrainer(BaseTrainer, SetupMixin):
        def configure_models(self):
            self.model = nn.Linear(1, 1)

        def configure_optimizers(self):
            self.optimizer = torch.optim.SGD(self.model.parameters(), lr=1e-3)

        def configure_dataloaders(self):
            stream = Counter(self.world.dp_rank, self.world.dp_size)
            batch = self.config.training_parameters.train_batch_size
            return StatefulDataLoader(stream, batch_size=batch), None

        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = F.mse_loss(self.model(x / 100), y / 100)
            self.backward(loss)
            self.step(self.model, self.optimizer)
            return {"loss": loss}

        def validation_step(self, batch, batch_idx):
            return {}


    class PackedStreamTrainer(StreamTrainer):
        def configure_models(self):
            self.model = nn.Embedding(100, 1)

        def configure_dataloaders(self):
            documents = [[(7 * d + i) % 100 for i in range(1 + d % 9)] for d in range(50)]
            stream = ShardedStream(documents, seed=0, sequence_length=8)
            return StatefulDataLoader(stream, batch_size=4,
                                      num_workers=self.config.num_workers), None

        def training_step(self, batch, batch_idx):
            loss = self.model(batch).pow(2).mean()
            self.backward(loss)
            self.step(self.model, self.optimizer)
            return {"loss": loss}


    def make_stream(args):
        return StreamTrainer(apply_cli_overrides(StreamConfig(
            project="docs", group="data", experiment="stream",
            training_parameters=TrainingParameters(n_epochs=None, max_steps=25,
                                                   train_batch_size=4)), args))


    def make_packed(args):
        return PackedStreamTrainer(apply_cli_overrides(StreamConfig(
            project="docs", group="data", experiment="packed",
            training_parameters=TrainingParameters(n_epochs=None, max_steps=5,
                                                   train_batch_size=4)), args))
''')

# Each case asks for 5 optimizer steps, more than its schedule has where that is possible:
# the stream's budget is 2 steps, or 1 epoch of 2 steps, or the packed stream's 5 steps.
CASES = {
    "stream, n_epochs=None and max_steps": ("make_stream", ["--training_parameters.max_steps",
                                                             "2"]),
    "stream, train_steps_per_epoch": ("make_stream", [
        "--training_parameters.n_epochs", "1", "--training_parameters.train_steps_per_epoch",
        "2"]),
    "ShardedStream, no workers": ("make_packed", []),
    "ShardedStream, 2 workers": ("make_packed", ["--num_workers", "2"]),
}

pytestmark = [pytest.mark.usefixtures("restore_imports"),
              pytest.mark.parametrize("case", list(CASES))]


def target(directory: Path, case: str) -> tuple[str, list[str]]:
    """The case's TARGET (the trainers written to ``directory``) and its overrides."""
    script = directory / "stream_trainers.py"
    script.write_text(TRAINERS)
    factory, overrides = CASES[case]
    return f"{script}:{factory}", overrides


def sandboxes(directory: Path) -> set[Path]:
    return set(directory.glob("dream-trainer-*"))


def test_benchmark_times_every_step_asked_for_on_a_stream(
        case: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, private_tempdir: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)  # the trainers' checkpoints and logs would default to ./outputs
    script, overrides = target(tmp_path, case)
    figures = tmp_path / "figures.json"
    assert main(["benchmark", script, "--steps", "4", "--warmup", "1", "--json", str(figures),
                 "--", *overrides]) == 0
    out = capsys.readouterr().out
    assert "steps: 4 measured after 1 warm-up steps (world size 1, device cpu)" in out
    assert "samples/s:" in out and "(4 samples per step = batch 4 x accumulation 1" in out
    written = json.loads(figures.read_text())
    assert (written["steps"], written["warmup_steps"], written["samples_per_step"]) == (4, 1, 4)
    assert len(written["step_times_s"]) == 4 and min(written["step_times_s"]) > 0
    assert written["samples_per_second"] == pytest.approx(4 * 4 / sum(written["step_times_s"]))
    assert sorted(path.name for path in tmp_path.iterdir()) == ["figures.json",
                                                                "stream_trainers.py"]
    assert sandboxes(private_tempdir) == set()


def test_profile_records_the_steps_asked_for_on_a_stream(
        case: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    script, overrides = target(tmp_path, case)
    out_dir = tmp_path / "profile"
    assert main(["profile", script, "--steps", "3", "--warmup", "2", "--out", str(out_dir),
                 "--", *overrides]) == 0
    out = capsys.readouterr().out
    assert "top operators by self CPU time (optimizer steps 3-5, rank 0):" in out
    assert "Self CPU" in out
    trace = json.loads((out_dir / "trace_rank0.json").read_text())
    steps = {event["name"] for event in trace["traceEvents"]
             if event.get("name", "").startswith("ProfilerStep#")}
    assert len(steps) == 3, steps  # the step that warms the profiler up is not kept
    assert f"trace: {out_dir / 'trace_rank0.json'}" in out
