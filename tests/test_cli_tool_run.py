"""The run every trainer command shares (``cli/tool_run.py``): a one-process command refuses
torchrun, and a run a callback stopped early fails with a message naming what was missing."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pytest
import torch.distributed as dist

from dream_trainer.cli import main
from dream_trainer.errors import StopTraining
from dream_trainer.trainer.callback import Callback
from tests.helpers.launch import REPO
from tests.scripts.cli_trainer import CliTrainer, make_trainer

pytestmark = pytest.mark.usefixtures("restore_imports")

TARGET = f"{REPO / 'tests' / 'scripts' / 'cli_trainer.py'}:make_trainer"
STOPPING = "tests.test_cli_tool_run:make_stopping_trainer"


class StopAfterTwoSteps(Callback):
    def post_optimizer_step(self, *args: object) -> None:
        if self.trainer.global_step >= 2:
            raise StopTraining("the test stops it")


def make_stopping_trainer(args: Sequence[str] | None = None) -> CliTrainer:
    trainer = make_trainer(args)
    trainer.callbacks.append(StopAfterTwoSteps())
    trainer.callbacks.attach(trainer)
    return trainer


# Without the refusal the command would wait for a second rank that never comes.
@pytest.mark.timeout(60)
def test_find_graph_breaks_refuses_a_torchrun_world(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    for name, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2",
                        "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
                        "MASTER_PORT": "29599"}.items():
        monkeypatch.setenv(name, value)
    assert main(["find-graph-breaks", TARGET]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err == ("dream-trainer find-graph-breaks: error: it runs in one process; "
                            "run it with python, not torchrun\n")
    assert not dist.is_initialized()  # refused before any process group was made


@pytest.mark.parametrize(("command", "missing"), [
    (["benchmark", "--warmup", "1", "--steps", "3"], "the 4 asked for"),
    (["profile", "--warmup", "3", "--steps", "2", "--out"], "the profiler recorded any"),
])
def test_a_run_stopped_early_fails_naming_what_is_missing(
        command: list[str], missing: str, tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    if command[-1] == "--out":
        command = [*command, str(tmp_path / "profile")]
    assert main([*command, STOPPING]) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.endswith(f"error: training ended after 2 optimizer steps, before "
                                 f"{missing} (a callback stopped it)\n")
    assert not dist.is_initialized()  # torn down as fit() tears down
