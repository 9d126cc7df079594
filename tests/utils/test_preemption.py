"""PreemptionAgreement: one process reads its flag; ranks vote about every ``seconds`` of
training, agree on the interval and stop at the same step."""

from __future__ import annotations

import json
import signal
from pathlib import Path

from dream_trainer.utils.preemption import PreemptionAgreement, PreemptionFlag
from tests.helpers.launch import REPO, check, torchrun


def test_one_process_reads_its_own_flag_at_every_step() -> None:
    flag = PreemptionFlag()
    agreement = PreemptionAgreement(flag, seconds=1.0)
    assert [agreement.poll() for _ in range(3)] == [False] * 3
    flag.signal = signal.SIGUSR1
    assert agreement.poll() and agreement.polls == 0  # no vote without peers


def test_ranks_vote_on_the_smallest_proposed_interval_and_stop_together(
        tmp_path: Path) -> None:
    check(torchrun(REPO / "tests/scripts/preemption_run.py", [str(tmp_path)], timeout=120))
    runs = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    assert runs[0] == runs[1]  # the same votes at the same steps, the same stop
    seen = runs[0]
    # Every step: the flag raised before step 23 is in that step's vote, read at step 24.
    assert seen["every_step"] == {"stopped_at": 24, "voted_at": list(range(1, 24)),
                                  "votes": 23}
    # About every 10/64 s: rank 0 proposes 10 steps, rank 1 (twice as slow) 5, and both take
    # 5. A vote starts at step 1, its proposal is read at step 2 (so 2, 7, 12, ...): the flag
    # joins the vote of step 27 and is read at step 32.
    assert seen["adaptive"] == {"stopped_at": 32, "voted_at": [1, 2, 7, 12, 17, 22, 27],
                                "votes": 7}
    # However many steps fit in `seconds`, at most 100 pass between votes: the flag joins the
    # vote of step 102 and is read at step 202.
    assert seen["capped"] == {"stopped_at": 202, "voted_at": [1, 2, 102], "votes": 3}
