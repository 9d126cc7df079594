"""A worker whose launcher died stops by itself within seconds and writes nothing afterwards.

torchrun starts its workers in sessions of their own, so a SIGKILL to torchrun (alone, or to
its process group) never reaches them; ``world.launcher_watch.LauncherWatch`` ends them.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dream_trainer.checkpoint.directory import complete_checkpoints, step_dirs
from dream_trainer.configs import DeviceParameters
from dream_trainer.world import DistributedWorld, LaunchEnvironment
from dream_trainer.world.launcher_watch import EXIT_CODE, POLL_SECONDS, LauncherWatch
from tests.helpers.launch import REPO, child_env, free_port, run_script, torchrun

SCRIPT = REPO / "tests/scripts/launcher_kill_run.py"
STEPS = Path("ckpt/tests/run/checkpoints")

EXIT_BOUND_SECONDS = 15.0
"""How long a worker may outlive its launcher. The watch polls every 0.5 s and measures
about a second here; the rest is room for a loaded 2-core machine."""
QUIET_SECONDS = 3.0
"""How long the checkpoint directory is watched after the workers are gone."""


def alive(pid: int) -> bool:
    """Whether ``pid`` runs: an orphan that has exited is a zombie until its new parent
    reaps it, which counts as gone."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def is_worker(pid: int) -> bool:
    """Whether ``pid`` is still one of this test's workers (not a reused pid)."""
    try:
        return str(SCRIPT) in Path(f"/proc/{pid}/cmdline").read_text().replace("\0", " ")
    except FileNotFoundError:
        return False


def listing(root: Path) -> tuple[list[int], list[int]]:
    """(every step directory, the complete checkpoints' steps)."""
    return ([step for step, _ in step_dirs(root)],
            [info.step for info in complete_checkpoints(root)])


def wait_for(condition: object, seconds: float, what: str) -> None:
    deadline = time.monotonic() + seconds
    while not condition():  # type: ignore[operator]
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {seconds} s waiting for {what}")
        time.sleep(0.05)


@pytest.mark.distributed
@pytest.mark.parametrize("nproc", [1, 2])
def test_sigkill_to_torchrun_alone_ends_its_workers_and_resume_continues(
        nproc: int, tmp_path: Path) -> None:
    root, pids = tmp_path / "run", tmp_path / "pids"
    pids.mkdir()
    checkpoints = root / STEPS
    command = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
               "--rdzv_backend=c10d", f"--rdzv_endpoint=127.0.0.1:{free_port()}",
               str(SCRIPT), str(root), str(pids)]
    with open(tmp_path / "out.txt", "w") as out, open(tmp_path / "err.txt", "w") as err:
        # Its own session, so that the finally below can end torchrun's group if the test
        # fails before the kill; the workers are in sessions torchrun gives them.
        launcher = subprocess.Popen(command, env=child_env(), stdout=out, stderr=err,
                                    start_new_session=True)
    workers: list[int] = []
    try:
        wait_for(lambda: len(list(pids.glob("rank_*"))) == nproc and
                 listing(checkpoints)[1], 120, "the workers' pids and a complete checkpoint")
        workers = [int((pids / f"rank_{rank}").read_text()) for rank in range(nproc)]
        assert all(alive(pid) for pid in workers)
        os.kill(launcher.pid, signal.SIGKILL)  # torchrun alone: the workers are not touched
        killed = time.monotonic()
        launcher.wait()
        wait_for(lambda: not any(alive(pid) for pid in workers), EXIT_BOUND_SECONDS,
                 f"the workers to exit after torchrun was killed ({EXIT_BOUND_SECONDS} s)")
        exited = time.monotonic() - killed
        at_exit = listing(checkpoints)
        time.sleep(QUIET_SECONDS)
        # Nothing was written after the workers stopped: no directory, no newer checkpoint.
        assert listing(checkpoints) == at_exit
        steps, complete = at_exit
        # At most the save the kill cut short is incomplete: the newest directory, which
        # resume skips (no dream_trainer.json); rotation had removed any older one.
        assert [step for step in steps if step not in complete] in ([], [steps[-1]])
        print(f"{nproc} rank(s) exited {exited:.2f} s after torchrun's SIGKILL; newest "
              f"complete checkpoint step_{complete[-1]}, step directories {steps}")
    finally:
        for pid in workers:
            if alive(pid) and is_worker(pid):
                os.kill(pid, signal.SIGKILL)
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
            launcher.wait()
    stderr = (tmp_path / "err.txt").read_text()
    watched = [rank for rank in range(nproc)
               if (f"dream_trainer: rank {rank} stops now, without saving: its launcher "
                   f"(pid {launcher.pid}, torchrun) is gone") in stderr]
    assert watched, stderr[-3000:]
    # A rank whose peer's watch ended it first may see the peer vanish in a collective
    # ("Connection reset by peer") before its own watch polls: it fails there, saving
    # nothing either (the directory was checked above).
    for rank in set(range(nproc)) - set(watched):
        assert f"fit() failed on rank {rank} of {nproc}" in stderr, stderr[-3000:]

    # The same command continues from the newest complete checkpoint; one more step here.
    newest = complete[-1]
    args = [root, tmp_path / "pids_resumed", "--max-steps", str(newest + 1)]
    (tmp_path / "pids_resumed").mkdir()
    resumed = run_script(SCRIPT, nproc, *args) if nproc == 1 else torchrun(
        SCRIPT, [str(arg) for arg in args], nproc=nproc)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resumed from {checkpoints / f'step_{newest}'} at global step {newest}" \
        in resumed.stderr
    assert f"rank=0 finished at step {newest + 1}" in resumed.stdout


def test_a_watch_whose_launcher_is_gone_ends_the_process_at_once_saying_why() -> None:
    # A parent pid that is not this child's stands for a launcher that died.
    code = ("import time\n"
            "from dream_trainer.world.launcher_watch import LauncherWatch\n"
            "LauncherWatch(launcher_pid=-7, rank=3).start()\n"
            "time.sleep(30)\n"
            "print('still running')\n")
    start = time.monotonic()
    result = subprocess.run([sys.executable, "-c", code], env=child_env(), capture_output=True,
                            text=True, timeout=60)
    elapsed = time.monotonic() - start
    assert result.returncode == EXIT_CODE
    assert "still running" not in result.stdout
    assert result.stderr.startswith("dream_trainer: rank 3 stops now, without saving: its "
                                    "launcher (pid -7, torchrun) is gone, so nothing would "
                                    "stop or restart this worker."), result.stderr
    assert elapsed < 25  # the interpreter's start-up, then one poll of POLL_SECONDS


def test_the_watch_keeps_a_process_whose_launcher_lives_and_stops_with_the_world() -> None:
    env = LaunchEnvironment.from_environ({"RANK": "0", "WORLD_SIZE": "1",
                                          "TORCHELASTIC_RUN_ID": "x"})
    assert env.launcher_pid == os.getppid()
    assert LaunchEnvironment.from_environ({"RANK": "0", "WORLD_SIZE": "1"}).launcher_pid is None
    watch = LauncherWatch(os.getppid(), rank=0, poll_seconds=0.01)
    watch.start()
    time.sleep(0.1)  # ten polls, each finding the launcher alive
    assert watch.running
    watch.stop()
    assert not watch.running

    # The world of a torchrun worker watches from launch() to shutdown(); an environment
    # without a launcher pid (no torchrun agent) starts no watch.
    world = DistributedWorld(DeviceParameters(device="cpu"),
                             env=LaunchEnvironment(launcher_pid=os.getppid()))
    assert world._launcher_watch is not None and not world._launcher_watch.running
    world.launch()
    try:
        assert world._launcher_watch.running
        assert POLL_SECONDS <= 1.0
    finally:
        world.shutdown()
    assert not world._launcher_watch.running
    assert DistributedWorld(DeviceParameters(device="cpu"),
                            env=LaunchEnvironment())._launcher_watch is None
