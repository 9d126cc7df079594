"""Kill a run anywhere, restart the same command, and finish with the uninterrupted result."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers.checkpointing import assert_same_state
from tests.helpers.launch import REPO, child_env, run_script, spawn_ranks

SCRIPT = REPO / "tests/scripts/checkpoint_run.py"

# Each rank count's kill points: before the first checkpoint, mid-epoch, right after an
# epoch-boundary save, during validation, and twice within the last epoch. One process runs
# 10 optimizer steps per epoch, two ranks 5.
KILLS = {1: ["step:1", "step:6", "epoch_end:0", "val:1", "step:23", "step:26"],
         2: ["step:1", "step:6", "epoch_end:0", "val:1", "step:11", "step:14"]}


def run(nproc: int, *args: str | Path) -> subprocess.CompletedProcess[str]:
    return run_script(SCRIPT, nproc, *args)


def run_until_done(nproc: int, *args: str | Path, attempts: int = 10) -> int:
    """Re-run the same command until it exits 0; return how many runs were killed."""
    for killed in range(attempts):
        result = run(nproc, *args)
        if result.returncode == 0:
            return killed
    raise AssertionError(f"still failing after {attempts} attempts:\n{result.stderr[-3000:]}")


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> dict[int, dict]:
    root = tmp_path_factory.mktemp("uninterrupted")
    states = {}
    for nproc in (1, 2):
        assert run(nproc, root / str(nproc), root / f"{nproc}.pt").returncode == 0
        states[nproc] = torch.load(root / f"{nproc}.pt")
    return states


@pytest.mark.distributed
@pytest.mark.parametrize("nproc", [1, 2])
def test_sigkill_anywhere_then_resume_is_bit_exact(nproc: int, tmp_path: Path,
                                                   uninterrupted: dict[int, dict]) -> None:
    (tmp_path / "markers").mkdir()
    killed = run_until_done(nproc, tmp_path / "run", tmp_path / "final.pt", "--markers",
                            tmp_path / "markers", "--kill", *KILLS[nproc])
    assert killed == len(KILLS[nproc])
    assert sorted(p.name for p in (tmp_path / "markers").iterdir()) == sorted(
        k.replace(":", "_") for k in KILLS[nproc])
    assert_same_state(torch.load(tmp_path / "final.pt"), uninterrupted[nproc])


@pytest.mark.distributed
def test_sigterm_on_one_rank_saves_exits_zero_and_resumes_exactly(
        tmp_path: Path, uninterrupted: dict[int, dict]) -> None:
    (tmp_path / "markers").mkdir()
    args = [str(tmp_path / "run"), str(tmp_path / "final.pt"), "--markers",
            str(tmp_path / "markers"), "--kill", "step:6", "--kill-rank", "1",
            "--signal", "SIGTERM", "--preemption-poll-seconds", "0"]
    procs = spawn_ranks(SCRIPT, args)
    outputs = [proc.communicate(timeout=180)[0] for proc in procs]
    assert [proc.returncode for proc in procs] == [0, 0], outputs
    # Rank 1 got the signal in step 6's post_train_batch. Voting every step
    # (preemption_poll_seconds=0), the ranks' vote started at the end of step 6 is read at the
    # end of step 7 (it runs in the background meanwhile): there every rank agrees, saves and
    # stops. (Their vote cadence by time is tests/utils/test_preemption.py's.)
    for rank, output in enumerate(outputs):
        assert f"rank={rank} preempted=True step=7" in output
    assert (tmp_path / "run/ckpt/tests/run/checkpoints/step_7/.metadata").is_file()
    resumed = spawn_ranks(SCRIPT, args)
    outputs = [proc.communicate(timeout=180)[0] for proc in resumed]
    assert [proc.returncode for proc in resumed] == [0, 0], outputs
    assert "preempted=False step=15" in outputs[0]
    assert_same_state(torch.load(tmp_path / "final.pt"), uninterrupted[2])


def epoch_ids(log: Path, epoch: int, before_batch: int | None = None) -> list[int]:
    ids = []
    for line in log.read_text().splitlines():
        record = json.loads(line)
        if record["epoch"] == epoch and (before_batch is None or record["batch_idx"] < before_batch):
            ids.extend(record["ids"])
    return ids


@pytest.mark.distributed
@pytest.mark.parametrize(("first", "second", "kill", "batches_before"), [
    # 2 ranks: checkpoint at step 8 = 3 steps into epoch 1 = 6 micro-batches per rank.
    (2, 1, "step:9", 6),
    # 1 rank: checkpoint at step 12 = 2 steps into epoch 1 = 4 micro-batches.
    (1, 2, "step:13", 4),
])
def test_resharded_resume_reads_exactly_the_unseen_samples(
        tmp_path: Path, first: int, second: int, kill: str, batches_before: int) -> None:
    (tmp_path / "markers").mkdir()
    first_log, second_log = tmp_path / "first.jsonl", tmp_path / "second.jsonl"
    common = [tmp_path / "run", tmp_path / "final.pt", "--markers", tmp_path / "markers"]
    assert run(first, *common, "--kill", kill, "--samples", first_log).returncode != 0
    # The second run keeps the global batch: micro-batch 4 x ranks x accumulation.
    common += ["--accumulation", 2 * first // second]
    # The trainer keeps per-rank state: it cannot be handed to another number of processes.
    refused = run(second, *common)
    assert refused.returncode != 0
    assert (f"keeps per-rank state (rank_state_dict) for {first} processes, and this run has "
            f"{second}") in refused.stderr
    result = run(second, *common, "--samples", second_log, "--no-rank-state")
    assert result.returncode == 0, result.stderr[-3000:]
    seen_before = epoch_ids(first_log, epoch=1, before_batch=batches_before)
    seen_after = epoch_ids(second_log, epoch=1)
    assert len(seen_before) == len(set(seen_before)) == 4 * batches_before * first
    assert not set(seen_before) & set(seen_after)
    assert sorted(seen_before + seen_after) == list(range(80))
    # The resumed run then trains the remaining epoch in full on its own topology.
    assert sorted(epoch_ids(second_log, epoch=2)) == list(range(80))


@pytest.mark.distributed
def test_torchrun_restarts_a_crashed_group_which_resumes_by_itself(
        tmp_path: Path, uninterrupted: dict[int, dict]) -> None:
    """Plain torchrun --max-restarts, without TORCH_DISABLE_SHARE_RDZV_TCP_STORE: the
    process group's store prefix names the restart attempt, so restarted workers never
    connect to the dead attempt's addresses (pytorch#135712)."""
    from tests.helpers.launch import free_port

    (tmp_path / "markers").mkdir()
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
               "--max-restarts=3", "--rdzv_backend=c10d",
               f"--rdzv_endpoint=127.0.0.1:{free_port()}", str(SCRIPT), str(tmp_path / "run"),
               str(tmp_path / "final.pt"), "--markers", str(tmp_path / "markers"),
               "--kill", "step:6", "step:11"]
    result = subprocess.run(command, env=child_env(), capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert sorted(p.name for p in (tmp_path / "markers").iterdir()) == ["step_11", "step_6"]
    assert_same_state(torch.load(tmp_path / "final.pt"), uninterrupted[2])
