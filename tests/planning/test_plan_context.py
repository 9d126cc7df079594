"""``dream-trainer plan`` under context parallelism: the cp axis's key/value traffic against
analytic bytes, and the activation memory per rank that splitting the sequence saves.

The model is tests/helpers/rotary_gpt.py's causal GPT (SDPA attention, a rotary table cut
with the sequence) as tests/planning/context_target.py builds it, planned on 4 ranks as
dp_shard=4 (cp=1) and as dp_shard=2 x cp=2: FSDP2 shards the weights over the same 4 ranks
in both (over dp_shard x cp in the second), so only the sequence's split differs.

The analytic key/value traffic of one micro-batch, per rank: in forward, every layer
all-gathers its keys and its values over cp, each gathered buffer being the whole
sequence's ``BATCH x SEQ x DIM`` float32 values (each rank gives ``SEQ / cp`` positions),
whatever cp is; in backward, their gradients (buffers of the same size) are reduce-scattered
back to their owners. So ``2 x LAYERS`` all-gathers and as many reduce-scatters of
``2 x LAYERS x BATCH x SEQ x DIM x 4`` bytes each kind, and one all-reduce of the float32
loss (each rank's part summed into the whole sequence's).
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from dream_trainer.cli import main
from dream_trainer.cli.target import load_trainer
from dream_trainer.planning.report import RankPlan
from dream_trainer.planning.simulate import plan_rank
from tests.helpers.rotary_gpt import DIM
from tests.planning.context_target import BATCH, SEQ

TARGET = "tests.planning.context_target:make_trainer"
LAYERS = 2  # GPTConfig.n_layers
FLOAT = 4


def kv_bytes(seq: int = SEQ) -> int:
    """Every layer's gathered keys and values (or their gradients) for sequences of ``seq``."""
    return 2 * LAYERS * BATCH * seq * DIM * FLOAT


KV_BYTES = kv_bytes()
CP1 = {"dp_shard": 4}
CP2 = {"dp_shard": 2, "context_parallel": 2}


def plan(device: dict[str, Any], world_size: int, *args: str,
         capsys: pytest.CaptureFixture[str]) -> dict[str, Any]:
    """Rank 0's figures from ``dream-trainer plan --json``."""
    assert main(["plan", TARGET, "--world-size", str(world_size), "--rank", "0", "--json",
                 "--", "--device_parameters", json.dumps(device), *args]) == 0
    figures: dict[str, Any] = json.loads(capsys.readouterr().out)["ranks"]["0"]
    return figures


def test_the_cp_axis_carries_each_layers_keys_and_values_forward_and_backward() -> None:
    rank: RankPlan = plan_rank(lambda: load_trainer(TARGET, ["--device_parameters",
                                                             json.dumps(CP2)]), 4, 3, 4)
    kinds = {kind: (traffic.count, traffic.bytes)
             for kind, traffic in rank.collective_kinds["cp"].items()}
    assert kinds == {"all_gather": (2 * LAYERS, KV_BYTES),
                     "reduce_scatter": (2 * LAYERS, KV_BYTES),
                     "all_reduce": (1, FLOAT)}


def test_cp_2_holds_less_activation_memory_per_rank_than_cp_1_on_the_same_shards(
        capsys: pytest.CaptureFixture[str]) -> None:
    whole, split = plan(CP1, 4, capsys=capsys), plan(CP2, 4, capsys=capsys)
    for key in ("param_bytes", "grad_bytes", "optimizer_bytes"):
        assert split[key] == whole[key]  # the same weights over the same 4 shards
    # Measured 0.63: every per-token activation halves, while each layer's gathered keys and
    # values, FSDP2's gathered weights and the micro-batch of tokens do not.
    assert split["activation_bytes"] < 0.7 * whole["activation_bytes"]
    traffic = {axis: (t["count"], t["bytes"]) for axis, t in split["collectives"].items()}
    assert set(traffic) == {"cp", "dp_shard", "dp_shard_cp"}
    assert traffic["cp"] == (4 * LAYERS + 1, 2 * KV_BYTES + FLOAT)
    # FSDP2's gathers and reductions move to dp_shard_cp unchanged; num_items (an int64)
    # is still summed over the data-parallel ranks alone, each cp rank counting every token.
    fsdp = traffic["dp_shard_cp"]
    assert traffic["dp_shard"] == (1, 8)
    assert (fsdp[0] + 1, fsdp[1] + 8) == (whole["collectives"]["dp_shard"]["count"],
                                          whole["collectives"]["dp_shard"]["bytes"])
    # With dp_shard=1 FSDP2 shards over the cp ranks themselves: one group, one axis, which
    # carries both (and no num_items: one data-parallel rank).
    alone = plan({"dp_shard": 1, "context_parallel": 2}, 2, capsys=capsys)
    assert set(alone["collectives"]) == {"cp"}
    assert (alone["collectives"]["cp"]["count"], alone["collectives"]["cp"]["bytes"]) == \
        (fsdp[0] + traffic["cp"][0], fsdp[1] + traffic["cp"][1])
    assert alone["activation_bytes"] == split["activation_bytes"]


def test_the_table_has_a_cp_column_and_says_what_it_carries(
        capsys: pytest.CaptureFixture[str]) -> None:
    note = "Under context parallelism the cp axis carries attention's all-gathers"
    assert main(["plan", TARGET, "--world-size", "4", "--rank", "0", "--",
                 "--device_parameters", json.dumps(CP1)]) == 0
    assert note not in capsys.readouterr().out.replace("\n", " ")
    assert main(["plan", TARGET, "--world-size", "4", "--rank", "0", "--",
                 "--device_parameters", json.dumps(CP2)]) == 0
    out = capsys.readouterr().out
    assert note in out.replace("\n", " ")
    lines = out.splitlines()
    assert lines[3].split()[:4] == ["4", "dp_shard=2", "x", "cp=2"]
    header = lines.index("collectives of one optimizer step per rank, by mesh axis (count, "
                         "bytes of their full buffers):")
    assert lines[header + 1].split() == ["world", "size", "cp", "dp_shard", "dp_shard_cp"]
    assert lines[header + 2].split()[:4] == ["4", str(4 * LAYERS + 1), "x,", "64"]  # KiB


def test_a_sequence_that_does_not_split_into_2_cp_chunks_fails_as_the_run_would(
        capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", TARGET, "--world-size", "4", "--json", "--", "--device_parameters",
                 json.dumps(CP2), "--seq_len", "62"]) == 1
    assert ("world size 4: rank 0 would fail with ValueError: a sequence of 62 positions "
            "does not split into 2 x context_parallel = 4 chunks (a head and a tail per "
            "rank, context_parallel_load_balance=True): pad or cut the sequences to a "
            "multiple of 4, or change context_parallel") in capsys.readouterr().err
    # Without load balancing each rank holds one contiguous chunk: 62 splits into 2.
    unbalanced = plan({**CP2, "context_parallel_load_balance": False}, 4, "--seq_len", "62",
                      capsys=capsys)
    assert unbalanced["collectives"]["cp"]["bytes"] == 2 * kv_bytes(62) + FLOAT
