"""The CSV and JSONL logs of a run killed with SIGKILL and resumed hold one value per step and
key: the resumed run's where both runs logged it."""

from __future__ import annotations

import csv
import json
import signal
import subprocess
import sys
from collections import Counter
from pathlib import Path

from tests.helpers.launch import REPO, child_env

SCRIPT = REPO / "tests/scripts/logged_kill_run.py"
LOGS = "logs/ckpt/tests/run/logs"
# 10 optimizer steps per epoch, 3 epochs, a checkpoint every 5 steps. Killed after step 13,
# the run resumes at step 10, the last step of epoch 0, saved after that epoch's end (its
# validation, its means), which the resumed run does not repeat; killed after step 27, it
# resumes mid-epoch at step 25.
KILLS = ["step:13", "step:27"]


def rows(root: Path) -> dict[str, list[dict[str, object]]]:
    """Each file's rows, as dicts of the keys it holds (empty CSV cells left out)."""
    with open(root / LOGS / "metrics.csv", newline="") as file:
        table = [{key: value for key, value in row.items() if value != ""}
                 for row in csv.DictReader(file)]
    lines = (root / LOGS / "metrics.jsonl").read_text().splitlines()
    return {"csv": [{key: value if key == "step" else float(value)  # type: ignore[arg-type]
                     for key, value in row.items()} for row in table],
            "jsonl": [json.loads(line) for line in lines]}


def test_sigkilled_and_resumed_runs_log_one_value_per_step_and_key(tmp_path: Path) -> None:
    (tmp_path / "markers").mkdir()
    for attempt, killed in [(1, True), (2, True), (3, False)]:
        done = subprocess.run([sys.executable, str(SCRIPT), str(tmp_path), str(attempt),
                               "--kill", *KILLS, "--markers", str(tmp_path / "markers")],
                              env=child_env(), cwd=REPO, capture_output=True, text=True,
                              timeout=240)
        assert done.returncode == (-signal.SIGKILL if killed else 0), done.stderr[-3000:]
    for name, table in rows(tmp_path).items():
        steps = [int(row["step"]) for row in table]  # type: ignore[call-overload]
        assert steps == sorted(steps), name  # one series, in order
        counts = Counter((int(row["step"]), key)  # type: ignore[call-overload]
                         for row in table for key in row if key != "step")
        assert max(counts.values()) == 1, (name, [k for k, n in counts.items() if n > 1])
        values = {key: value for key, value in
                  (((int(row["step"]), key), value)  # type: ignore[call-overload]
                   for row in table for key, value in row.items() if key != "step")}
        # Every step and epoch end logged once, each by the run that reached it last.
        assert sorted(step for step, key in values if key == "loss") == list(range(1, 31))
        assert sorted(step for step, key in values if key == "val_loss") == [10, 20, 30]
        assert {step: values[step, "attempt"] for step in range(1, 31)} == {
            step: 1.0 if step <= 10 else 2.0 if step <= 25 else 3.0 for step in range(1, 31)}
        assert {step: values[step, "train_epoch/attempt"] for step in (10, 20, 30)} == {
            10: 1.0, 20: 2.0, 30: 3.0}
        # Epoch 0's end came before the checkpoint of step 10: validated once, by attempt 1.
        assert {step: values[step, "val_attempt"] for step in (10, 20, 30)} == {
            10: 1.0, 20: 2.0, 30: 3.0}
