"""What packing from one global order costs up front: the length index of a million documents.

A packed ``ShardedStream`` needs every document's token count before its first sample. This
writes ``documents`` documents of 1 to 63 tokens (32 on average) as a local parquet file,
loads it with ``datasets``, and times each way the index is found: from the ``input_ids``
column by Arrow (the default for a ``datasets.Dataset``), from a length column
(``lengths="length"``), from the cache file a first build wrote (``index_cache``), and by
reading every document once through ``datasets`` (a custom ``tokens`` function, which the
Arrow path cannot see through). The last is timed on ``read_documents`` documents and scaled
to a million. It also times the first sample of a pass (its permutation and token offsets)
and reports the memory: the index, and the two per-pass tensors every reading process holds.

    python -m benchmarks.stream_index [--documents 1000000] [--read-documents 100000]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any

from dream_trainer.data import ShardedStream
from dream_trainer.data.sharded import _Samples

SEQUENCE = 2048


def write_corpus(directory: Path, documents: int) -> Any:
    """``documents`` documents of 1 to 63 token ids, with their lengths in a column."""
    import datasets
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    draw = np.random.default_rng(0)
    lengths = draw.integers(1, 64, documents)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    values = pa.array(draw.integers(0, 50_000, int(offsets[-1])).astype(np.int32))
    table = pa.table({"input_ids": pa.LargeListArray.from_arrays(pa.array(offsets), values),
                      "length": pa.array(lengths)})
    pq.write_table(table, directory / "corpus.parquet")
    return datasets.load_dataset("parquet", data_files=str(directory / "corpus.parquet"),
                                 split="train", cache_dir=str(directory / "hf_cache"))


def timed(build: Any) -> tuple[float, ShardedStream]:
    start = time.perf_counter()
    stream = build()
    return time.perf_counter() - start, stream


def measure(documents: int = 1_000_000, read_documents: int = 100_000) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        corpus = write_corpus(Path(tmp), documents)
        cache = Path(tmp) / "lengths.bin"
        seconds: dict[str, float] = {}
        seconds["arrow"], stream = timed(lambda: ShardedStream(corpus,
                                                               sequence_length=SEQUENCE))
        seconds["column"], _ = timed(lambda: ShardedStream(corpus, sequence_length=SEQUENCE,
                                                           lengths="length"))
        ShardedStream(corpus, sequence_length=SEQUENCE, index_cache=cache)  # writes it
        seconds["cache"], _ = timed(lambda: ShardedStream(corpus, sequence_length=SEQUENCE,
                                                          index_cache=cache))
        part = corpus.select(range(min(read_documents, documents)))
        read, _ = timed(lambda: ShardedStream(part, sequence_length=SEQUENCE,
                                              tokens=lambda row: row["input_ids"]))
        seconds["read_each_per_million"] = read * 1_000_000 / len(part)
        samples = _Samples(stream)
        start = time.perf_counter()
        first = samples[0]
        seconds["first_sample_of_a_pass"] = time.perf_counter() - start
        assert first.numel() == SEQUENCE
        assert stream.lengths is not None
        index_bytes = stream.lengths.element_size() * stream.lengths.numel()
        pass_bytes = sum(t.element_size() * t.numel() for t in (samples.order, samples.ends))
        tokens = int(stream.lengths.sum())
    return {"documents": documents, "tokens": tokens, "read_documents": len(part),
            "seconds": seconds, "index_mib": index_bytes / 2**20,
            "per_pass_mib": pass_bytes / 2**20,
            "cache_mib": cache.stat().st_size / 2**20 if cache.exists() else index_bytes / 2**20}


def markdown(result: dict[str, Any]) -> list[str]:
    seconds, millions = result["seconds"], result["documents"] / 1e6
    where = f"{result['documents']:,} documents"
    return [
        f"| length index of {where}: Arrow column / length column / cache file | "
        f"{seconds['arrow']:.3f} s / {seconds['column']:.3f} s / {seconds['cache']:.3f} s |",
        f"| length index by reading every document through `datasets`, per million | "
        f"{seconds['read_each_per_million']:.0f} s |",
        f"| first sample of a pass of {where} (permutation and offsets) | "
        f"{seconds['first_sample_of_a_pass'] * 1e3:.0f} ms |",
        f"| memory per million documents: index / per pass, per reading process | "
        f"{result['index_mib'] / millions:.1f} MiB / {result['per_pass_mib'] / millions:.1f} "
        "MiB |",
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--documents", type=int, default=1_000_000)
    parser.add_argument("--read-documents", type=int, default=100_000)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    result = measure(args.documents, args.read_documents)
    print("\n".join(markdown(result)))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
