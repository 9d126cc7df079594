"""No link is followed in a run's or an export's folders: a symlink planted (before the run,
or by another process while an export runs) as the run lock, a log file or folder, a hang
record folder, a step directory or a file in it, or an export's staging directory, is
refused or replaced, and what it points to is never written, moved or deleted."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file
from torch.distributed.checkpoint.api import CheckpointException

from dream_trainer.callbacks.hang_files import private_trace_dir, write_file
from dream_trainer.checkpoint import CheckpointError, export_checkpoint
from dream_trainer.checkpoint.lock import LOCK, RunLock
from dream_trainer.checkpoint.no_follow import NoFollowWriter
from dream_trainer.checkpoint.storage import LocalStorage
from dream_trainer.configs import LoggingParameters
from dream_trainer.utils.files import LinkRefused
from tests.helpers.checkpointing import CheckpointedTrainer, checkpointed_config
from tests.scripts.logged_kill_run import LoggedConfig, LoggedTrainer

RUN = "ckpt/tests/run"
INDEX = "model.safetensors.index.json"


def state(directory: Path) -> dict[str, tuple[str, int]]:
    """Every entry under ``directory``: a file's SHA-256 and mtime, a link's target."""
    found = {}
    for path in sorted(directory.rglob("*")):
        key = str(path.relative_to(directory))
        if path.is_symlink():
            found[key] = (f"-> {os.readlink(path)}", 0)
        elif path.is_file():
            found[key] = (hashlib.sha256(path.read_bytes()).hexdigest(), path.stat().st_mtime_ns)
    return found


def outside(tmp_path: Path) -> Path:
    """A directory of someone else's files, with known contents."""
    victim = tmp_path / "victim"
    (victim / "sub").mkdir(parents=True)
    for number in range(3):
        (victim / f"file{number}.safetensors").write_bytes(os.urandom(64))
    (victim / "sub" / "keep.txt").write_text("mine")
    (victim / "notes.txt").write_text("do not touch")
    return victim


def trainer(root: Path, **checkpoint: object) -> CheckpointedTrainer:
    config = checkpointed_config(root, **checkpoint)
    return CheckpointedTrainer(config.model_copy(update={
        "training_parameters": config.training_parameters.model_copy(update={"n_epochs": 1})}))


# -- the run lock -------------------------------------------------------------------------------
def test_a_link_planted_as_the_lock_refuses_the_run_and_leaves_its_target(tmp_path: Path) -> None:
    victim = outside(tmp_path)
    checkpoints = tmp_path / RUN / "checkpoints"
    checkpoints.mkdir(parents=True)
    (checkpoints / LOCK).symlink_to(victim / "notes.txt")
    before = state(victim)

    expected = rf"the run lock {checkpoints / LOCK} is a symbolic link: .* Delete it"
    with pytest.raises(CheckpointError, match=expected):
        RunLock(checkpoints).acquire()
    with pytest.raises(CheckpointError, match=expected):
        trainer(tmp_path).fit()
    assert state(victim) == before

    # A link planted as the checkpoint directory itself is refused too.
    (checkpoints / LOCK).unlink()
    checkpoints.rmdir()
    checkpoints.symlink_to(victim)
    with pytest.raises(CheckpointError, match=rf"{checkpoints} is a symbolic link .*delete it"):
        RunLock(checkpoints).acquire()
    assert state(victim) == before


# -- step directories and their files -----------------------------------------------------------
@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # one process, on purpose
def test_a_link_planted_as_a_step_directory_is_removed_and_never_written_through(
        tmp_path: Path) -> None:
    victim = outside(tmp_path)
    checkpoints = tmp_path / RUN / "checkpoints"
    checkpoints.mkdir(parents=True)
    (checkpoints / "step_4").symlink_to(victim)  # the first save of the run
    before = state(victim)
    trainer(tmp_path, every_n_steps=4).fit()
    assert state(victim) == before
    step = checkpoints / "step_4"
    assert not step.is_symlink() and (step / ".metadata").is_file()

    # Storage and the DCP writer on their own: a link as the directory, or as a file in it.
    linked = tmp_path / "linked"
    linked.symlink_to(victim)
    with pytest.raises(LinkRefused, match=rf"{linked} is a symbolic link"):
        LocalStorage().make_dir(linked)
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    (fresh / "__0_0.distcp").symlink_to(victim / "file0.safetensors")
    with pytest.raises(CheckpointException, match=rf"{fresh / '__0_0.distcp'} is a symbolic"):
        dcp.save({"x": torch.ones(3)}, storage_writer=NoFollowWriter(fresh), no_dist=True)
    with pytest.raises(CheckpointException, match=rf"{linked} is a symbolic link"):
        dcp.save({"x": torch.ones(3)}, storage_writer=NoFollowWriter(linked), no_dist=True)
    assert state(victim) == before


# -- logs and hang records ----------------------------------------------------------------------
def logged(root: Path) -> LoggedTrainer:
    base = checkpointed_config(root)
    fields = {name: getattr(base, name) for name in type(base).model_fields}
    fields["training_parameters"] = base.training_parameters.model_copy(update={"n_epochs": 1})
    return LoggedTrainer(LoggedConfig(**fields, logging_parameters=LoggingParameters(
        log_dir=root / "logs", log_every_n_steps=1)))


@pytest.mark.parametrize("planted", ["run", "run/logs", "run/logs/metrics.csv",
                                     "run/logs/metrics.jsonl"])
def test_a_link_planted_as_a_log_file_or_folder_is_refused(tmp_path: Path, planted: str) -> None:
    root = tmp_path / "run"
    victim = outside(tmp_path)
    link = root / "logs" / "ckpt" / "tests" / planted
    link.parent.mkdir(parents=True)
    link.symlink_to(victim / "notes.txt" if planted.endswith("l") or planted.endswith("v")
                    else victim)
    before = state(victim)
    with pytest.raises(LinkRefused, match=rf"{link} is a symbolic link .*delete it"):
        logged(root).fit()
    assert state(victim) == before


def test_a_link_planted_as_the_hang_record_folder_is_refused(tmp_path: Path) -> None:
    victim = outside(tmp_path)
    hang = tmp_path / "trace" / "hang"
    hang.parent.mkdir()
    hang.symlink_to(victim)
    before = state(victim)
    with pytest.raises(LinkRefused, match=rf"{hang} is a symbolic link"):
        write_file(hang, "hang_rank0.json", b"{}")
    # In the private default directory, a link as any folder of the run is refused.
    project = f"no-links-{os.getpid()}-{time.monotonic_ns()}"
    default = private_trace_dir(project, "group", "experiment")
    planted = default.parents[2]  # <private>/<project>
    planted.symlink_to(victim)
    try:
        with pytest.raises(LinkRefused, match=rf"{planted} is a symbolic link"):
            write_file(default, "hang_rank0.json", b"{}")
    finally:
        planted.unlink()
    assert state(victim) == before
    assert write_file(tmp_path / "own" / "hang", "hang_rank0.json", b"{}").read_bytes() == b"{}"


# -- an export raced by another process ---------------------------------------------------------
REPLANTER = """
import os, sys, time
out, victim, known, deadline = sys.argv[1], sys.argv[2], set(sys.argv[3].split("/")), \\
    time.monotonic() + float(sys.argv[4])
moved = planted = 0
while time.monotonic() < deadline:
    try:
        names = os.listdir(out)
    except OSError:
        continue
    for name in names:
        path = os.path.join(out, name)
        # What the export creates in OUT_DIR beside its results: its staging directories.
        if name in known or not name.startswith(".") or name.startswith(".moved") \\
                or os.path.islink(path):
            continue
        try:
            os.rename(path, os.path.join(out, f".moved{moved}"))
            moved += 1
            os.symlink(victim, path)
            planted += 1
        except OSError:
            continue
        count = os.path.join(out, "..", "planted")
        with open(f"{count}.tmp", "w") as file:
            file.write(str(planted))
        os.replace(f"{count}.tmp", count)  # the test reads it meanwhile
print(planted, flush=True)
"""


@pytest.fixture(scope="module")
def step(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("run")
    trainer(root).fit()
    return root / RUN / "checkpoints" / "step_10"


def hf_tensors(directory: Path) -> dict[str, torch.Tensor]:
    """All tensors of a Hugging Face weights directory, through its index."""
    files = set(json.loads((directory / INDEX).read_text())["weight_map"].values())
    return {key: value for name in sorted(files)
            for key, value in load_file(directory / name).items()}


def test_an_export_raced_by_a_process_replanting_its_staging_never_touches_outside(
        step: Path, tmp_path: Path) -> None:
    victim = outside(tmp_path)
    reference = tmp_path / "reference"
    export_checkpoint(step, reference, format="hf", max_shard_bytes=1)
    expected = hf_tensors(reference)
    assert len(json.loads((reference / INDEX).read_text())["weight_map"]) == 4
    out = tmp_path / "race" / "out"
    out.mkdir(parents=True)
    (out / "notes.txt").write_text("kept")
    before = state(victim)

    replanter = subprocess.Popen(
        [sys.executable, "-c", REPLANTER, str(out), str(victim), "notes.txt", "20"],
        stdout=subprocess.PIPE, text=True)
    outcomes: list[str] = []
    try:
        deadline = time.monotonic() + 15
        # At least 3 exports, and until the replanter struck a few times (bounded).
        while len(outcomes) < 3 or (time.monotonic() < deadline and (
                not (tmp_path / "race" / "planted").exists()
                or int((tmp_path / "race" / "planted").read_text()) < 3)):
            try:
                export_checkpoint(step, out, format="hf", max_shard_bytes=1, overwrite=True)
            except CheckpointError as exc:
                assert "staging directory" in str(exc) and "was renamed or replaced" in str(exc)
                outcomes.append("refused")
            else:
                found = hf_tensors(out)
                assert found.keys() == expected.keys()
                assert all(torch.equal(found[key], expected[key]) for key in expected)
                outcomes.append("exported")
    finally:
        replanter.kill()
        replanter.wait(timeout=30)
    planted = int((tmp_path / "race" / "planted").read_text())
    assert planted >= 1, outcomes  # the race happened
    assert state(victim) == before  # nothing written, moved in or out, or deleted there
    assert (out / "notes.txt").read_text() == "kept"
    # Without the replanter, the next export completes and clears the links it left.
    export_checkpoint(step, out, format="hf", max_shard_bytes=1, overwrite=True)
    found = hf_tensors(out)
    assert all(torch.equal(found[key], expected[key]) for key in expected)
    assert not [name for name in os.listdir(out) if name.startswith(".model.partial")]
    assert state(victim) == before
