"""A packed ShardedStream read on 4 ranks x 2 workers, SIGKILLed mid-epoch, resumed on 2 ranks
x 1 worker, SIGKILLed again, and finished on 3 ranks x 2 workers: over the whole run every
token is trained on exactly as often as the stream's merged position says it was read (no
token twice, none lost), and that position covers the whole dataset. Once with a list of
documents, once with a Hugging Face ``datasets`` source built from local parquet files."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from dream_trainer.data import ShardedStream
from dream_trainer.data.sharded import merge_progress
from tests.helpers.launch import REPO, run_script
from tests.helpers.sharded import DOCUMENTS, documents

SCRIPT = REPO / "tests/scripts/sharded_stream_run.py"
CHECKPOINT_EVERY, MAX_STEPS = 4, 16
# (ranks, workers, the step rank 0 is killed after); each resumes from the newest checkpoint.
CHAIN = [(4, 2, 6), (2, 1, 10), (3, 2, None)]


def parquet_dataset(tmp_path: Path) -> Path:
    """The documents as two local parquet shards, loaded by ``datasets`` and saved as arrow."""
    if (tmp_path / "arrow").exists():
        return tmp_path / "arrow"
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


def trained_tokens(log_dir: Path, first_step: int, last_step: int) -> list[int]:
    """Tokens of the steps ``first_step`` to ``last_step`` (steps done before each) of every
    rank's log: the steps a checkpoint kept."""
    tokens = []
    for log in sorted(log_dir.glob("rank*.jsonl")):
        for line in log.read_text().splitlines():
            entry = json.loads(line)
            if first_step <= entry["step"] <= last_step:
                tokens.extend(t for row in entry["tokens"] for t in row)
    return tokens


SOURCES = ("datasets", "list")


@pytest.fixture(scope="module")
def chain(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The three launches of CHAIN, each running both sources' runs (see the script)."""
    tmp_path = tmp_path_factory.mktemp("sharded_stream")
    (tmp_path / "markers").mkdir()
    for launch, (ranks, workers, kill) in enumerate(CHAIN):
        args = [tmp_path / "run", tmp_path / f"log{launch}", "--sources", ",".join(SOURCES),
                "--data", parquet_dataset(tmp_path), "--workers", str(workers),
                "--max-steps", str(MAX_STEPS)]
        if kill is not None:
            args += ["--kill", f"step:{kill}", "--markers", tmp_path / "markers"]
        result = run_script(SCRIPT, ranks, *args)
        if kill is None:
            assert result.returncode == 0, result.stderr[-3000:]
        else:  # the marker says the kill came where it was meant to, not an earlier failure
            assert result.returncode != 0 and (tmp_path / "markers" / f"step_{kill}").exists(), \
                result.stderr[-3000:]
    return tmp_path


@pytest.mark.distributed
@pytest.mark.parametrize("source", SOURCES)
def test_packed_stream_resumed_on_other_ranks_and_workers_reads_every_token_once(
        source: str, chain: Path) -> None:
    tokens: list[int] = []
    first_step = 0
    for launch, (_, _, kill) in enumerate(CHAIN):
        last_step = MAX_STEPS - 1 if kill is None \
            else kill // CHECKPOINT_EVERY * CHECKPOINT_EVERY - 1
        tokens += trained_tokens(chain / f"log{launch}" / source, first_step, last_step)
        first_step = last_step + 1
    # Each run resumed from the checkpoint before its kill and finished the step budget.
    assert max(int(p.name.removeprefix("step_"))
               for p in (chain / "run" / source).glob("**/step_*")) == MAX_STEPS

    pieces = [json.loads((chain / "log2" / source / f"piece{rank}.json").read_text())
              for rank in range(CHAIN[-1][0])]
    progress = merge_progress(pieces)
    stream = ShardedStream(documents(), seed=5)
    expected: list[int] = []
    for start, stop in progress.consumed:
        for position in range(start, stop):
            expected += stream.item(position)
    for position, read in progress.partial.items():
        expected += stream.item(position)[:read]
    assert Counter(tokens) == Counter(expected)
    # The run read past the first pass: every document was read whole at least once.
    assert progress.consumed[0][0] == 0 and progress.consumed[0][1] >= DOCUMENTS
    assert set(Counter(tokens)) == {t for doc in documents() for t in doc}
