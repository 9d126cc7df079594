"""ShardedStream under the trainer, on a ``datasets`` source built from local parquet files.

- On 2 ranks x 2 loader workers, a run SIGKILLed after a checkpoint and rerun ends with the
  uninterrupted run's weights, bit for bit: packed in order as documents (supervised
  fine-tuning's packing), packed with the default shuffle, and unpacked.
- The packed stream on 1, 2 and 4 ranks with one global batch (12 samples) trains on the same
  global batches, in the same order, and SGD ends with one process's weights (to 1e-6: the
  mean over ranks rounds differently from one mean).
- Killed on 4 ranks x 2 workers, resumed on 2 x 1, killed again and finished on 3 x 2, the
  run trains on one process's global batches, in order: every remaining sample once.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.helpers.launch import REPO, run_script
from tests.helpers.sharded import documents
from tests.helpers.tolerance import assert_close_to_scale

SCRIPT = REPO / "tests/scripts/sharded_stream_run.py"
CHECKPOINT_EVERY = 3  # the script's
# 2 ranks x 2 workers, AdamW; the in-order run packs documents (ShardedStream(documents=True)
# and the documents' attention context in the step, the loss on each document's second half).
EXACT_RUNS = ("inorder:2:pd", "shuffled:2:sp", "items:2:s")
STEPS, EXACT_KILL, GLOBAL_BATCH = 12, 5, 12
# The resumed chain: (ranks, workers, step it is killed after; None: it finishes).
CHAIN = [(4, 2, 5), (2, 1, 8), (3, 2, None)]


def parquet_dataset(tmp_path: Path) -> Path:
    """The documents as two local parquet shards, loaded by ``datasets`` and saved as arrow."""
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    docs = documents()
    files = []
    for index, part in enumerate((docs[:20], docs[20:])):
        files.append(str(tmp_path / f"shard{index}.parquet"))
        pq.write_table(pa.table({"input_ids": part}), files[-1])
    loaded = datasets.load_dataset("parquet", data_files=files, split="train",
                                   cache_dir=str(tmp_path / "hf_cache"))
    assert [row["input_ids"] for row in loaded] == docs
    loaded.save_to_disk(str(tmp_path / "arrow"))
    return tmp_path / "arrow"


def launch(tmp_path: Path, ranks: int, workers: int, max_steps: int, log: str,
           runs: list[str], kill: int | None = None) -> None:
    args: list[Any] = [tmp_path / "run", tmp_path / log, "--data", tmp_path / "arrow",
                       "--workers", workers, "--max-steps", max_steps]
    for spec in runs:
        args += ["--run", spec]
    if kill is not None:
        args += ["--kill-step", kill, "--markers", tmp_path / "markers"]
    result = run_script(SCRIPT, ranks, *args)
    if kill is None:
        assert result.returncode == 0, result.stderr[-3000:]
    else:  # the marker says the kill came where it was meant to, not an earlier failure
        assert result.returncode != 0 and (tmp_path / "markers" / f"step_{kill}").exists(), \
            result.stderr[-3000:]
        (tmp_path / "markers" / f"step_{kill}").unlink()


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Six launches: 1 rank; 2 ranks (uninterrupted runs, then runs killed); 2 ranks (the
    killed runs resumed); the 4 -> 2 -> 3 chain (its first launch also runs 4 ranks whole)."""
    tmp_path = tmp_path_factory.mktemp("sharded_stream")
    (tmp_path / "markers").mkdir()
    parquet_dataset(tmp_path)
    launch(tmp_path, 1, 2, STEPS, "one", [f"sgd1:{GLOBAL_BATCH}:spg"])
    # Uninterrupted first; then the same runs killed after step 5, the last by SIGKILL.
    launch(tmp_path, 2, 2, STEPS, "first", [f"sgd2:{GLOBAL_BATCH // 2}:spg",
                                            *(f"whole-{s}" for s in EXACT_RUNS),
                                            *(f"split-{s}k" for s in EXACT_RUNS)],
           kill=EXACT_KILL)
    launch(tmp_path, 2, 2, STEPS, "resumed", [f"split-{s}" for s in EXACT_RUNS])
    batch4 = GLOBAL_BATCH // 4
    launch(tmp_path, 4, 2, STEPS, "chain0",
           [f"sgd4:{batch4}:spg", f"chain:{batch4}:spgk"], kill=CHAIN[0][2])
    for link, (ranks, workers, kill) in enumerate(CHAIN[1:], 1):
        launch(tmp_path, ranks, workers, STEPS, f"chain{link}",
               [f"chain:{GLOBAL_BATCH // ranks}:spg" + ("k" if kill else "")], kill=kill)
    return tmp_path


def global_batches(log_dir: Path, first: int = 0, last: int = 10**9) -> list[list[Any]]:
    """Each step's samples from every rank's log (steps ``first`` to ``last``), rank by rank."""
    steps: dict[int, dict[int, list[Any]]] = {}
    for log in sorted(log_dir.glob("rank*.jsonl")):
        rank = int(log.stem.removeprefix("rank"))
        for line in log.read_text().splitlines():
            entry = json.loads(line)
            if first <= entry["step"] <= last:
                steps.setdefault(entry["step"], {})[rank] = entry["samples"]
    return [[sample for rank in sorted(ranks) for sample in ranks[rank]]
            for _, ranks in sorted(steps.items())]


def weights(log_dir: Path) -> dict[str, torch.Tensor]:
    saved = torch.load(log_dir / "final.pt")
    return {name.removeprefix("module."): tensor for name, tensor in saved["weights"].items()}


def last_kept(kill: int) -> int:
    """The last step before the checkpoint a run killed after ``kill`` resumes from."""
    return kill // CHECKPOINT_EVERY * CHECKPOINT_EVERY - 1


@pytest.mark.distributed
@pytest.mark.parametrize("spec", EXACT_RUNS)
def test_a_sigkilled_run_rerun_on_the_same_layout_is_bit_exact(spec: str, runs: Path) -> None:
    run = spec.split(":")[0]
    whole, resumed = runs / "first" / f"whole-{run}", runs / "resumed" / f"split-{run}"
    expected, actual = weights(whole), weights(resumed)
    assert expected.keys() == actual.keys()
    for name, tensor in expected.items():
        assert torch.equal(actual[name], tensor), name
    # The steps after the checkpoint read the uninterrupted run's batches, in its order.
    kept = last_kept(EXACT_KILL)
    assert global_batches(resumed, kept + 1) == global_batches(whole, kept + 1)
    assert global_batches(runs / "first" / f"split-{run}", 0, kept) \
        == global_batches(whole, 0, kept)


@pytest.mark.distributed
def test_one_global_batch_is_the_same_samples_on_1_2_and_4_ranks(runs: Path) -> None:
    one = global_batches(runs / "one" / "sgd1")
    assert len(one) == STEPS and all(len(batch) == GLOBAL_BATCH for batch in one)
    for ranks, log in ((2, runs / "first" / "sgd2"), (4, runs / "chain0" / "sgd4")):
        assert global_batches(log) == one, ranks
        reference, other = weights(runs / "one" / "sgd1"), weights(log)
        for name, tensor in reference.items():
            # The same samples, their gradients summed over ranks in another order.
            assert_close_to_scale(other[name], tensor, ulps=16, msg=name)


@pytest.mark.distributed
def test_resumed_on_other_layouts_every_remaining_sample_is_read_once_in_order(
        runs: Path) -> None:
    read, first = [], 0
    for link, (_, _, kill) in enumerate(CHAIN):
        last = STEPS - 1 if kill is None else last_kept(kill)
        read += global_batches(runs / f"chain{link}" / "chain", first, last)
        first = last + 1
    assert read == global_batches(runs / "one" / "sgd1")
