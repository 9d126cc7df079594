"""``dream-trainer plan``'s figures against analytic values, for FSDP, HSDP and FSDP x TP.

One child process plans tests/scripts/plan_trainer.py's GPT in every layout at 8, 64 and
1,024 ranks, as rank 0 and as the last rank (each plan creates and destroys its own fake
process group, so none outlives the child). The analytic side follows FSDP2's layout: each
parameter (after tensor parallelism's split) is cut along dim 0 into ``dp_shard`` chunks of
``ceil(rows / dp_shard)`` rows, and every rank stores a full chunk (the padding), while
AdamW's moments have exactly the rows the rank owns (none, past the end). Under a pipeline
(GPipe and 1F1B over two stages) a rank holds its stage's blocks and root parameters, and
sends and receives one microbatch activation per microbatch each way.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from typing import Any

import pytest

from tests.helpers.launch import REPO, check, child_env
from tests.scripts.plan_trainer import BATCH, DIM, LAYERS, SEQ, TP_PLAN, VOCAB

SIZES = (8, 64, 1024)
LAYOUTS = {
    "fsdp": {"dp_replicate": 1, "dp_shard": "auto"},
    "hsdp": {"dp_replicate": "auto", "dp_shard": 4},
    "fsdp_tp": {"dp_replicate": 1, "dp_shard": "auto", "tensor_parallel": 4},
    # One block per stage; each micro-batch of BATCH rows splits into MICRO microbatches.
    "pp_fsdp_gpipe": {"dp_replicate": 1, "dp_shard": "auto", "pipeline_parallel": 2,
                      "pipeline_schedule": "GPipe", "pipeline_microbatches": 2},
    "pp_fsdp_1f1b": {"dp_replicate": 1, "dp_shard": "auto", "pipeline_parallel": 2,
                     "pipeline_schedule": "1F1B", "pipeline_microbatches": 2},
}
FLOAT = 4  # float32 parameters, gradients, moments and activations
STEP = 4  # AdamW's step counter: a float32 scalar per parameter


def block_shapes() -> dict[str, tuple[int, ...]]:
    return {"attn_norm.weight": (DIM,), "q.weight": (DIM, DIM), "k.weight": (DIM, DIM),
            "v.weight": (DIM, DIM), "o.weight": (DIM, DIM), "mlp_norm.weight": (DIM,),
            "up.weight": (4 * DIM, DIM), "down.weight": (DIM, 4 * DIM)}


def units(stage: int = 0, stages: int = 1) -> list[dict[str, tuple[int, ...]]]:
    """FSDP2 units of one pipeline stage, in order: each of its blocks (with its TP style),
    then the root's own parameters (the embedding on the first stage, the final norm and
    head on the last)."""
    root = {"embed.weight": (VOCAB, DIM)} if stage == 0 else {}
    if stage == stages - 1:
        root.update({"norm.weight": (DIM,), "head.weight": (VOCAB, DIM)})
    return [block_shapes() for _ in range(LAYERS // stages)] + [root]


def tp_local(name: str, shape: tuple[int, ...], tp: int) -> tuple[int, ...]:
    """The shape a rank holds after ColwiseParallel (rows) or RowwiseParallel (columns)."""
    style = TP_PLAN.get(name.split(".")[0])
    if tp == 1 or style is None:
        return shape
    if style == "colwise":
        return (shape[0] // tp, *shape[1:])
    return (shape[0], shape[1] // tp)


def analytic(layout: dict[str, Any], world_size: int, rank: int) -> dict[str, Any]:
    tp, pp = layout.get("tensor_parallel", 1), layout.get("pipeline_parallel", 1)
    shard = layout["dp_shard"] if layout["dp_shard"] != "auto" else world_size // (tp * pp)
    replicate = world_size // (shard * tp * pp)
    shard_index = (rank // tp) % shard
    stage = rank // (world_size // pp)  # pp is the outermost mesh axis
    padded = owned = tensors = 0
    unit_bytes = []
    for unit in units(stage, pp):
        unit_padded = 0
        for name, shape in unit.items():
            rows, *rest = tp_local(name, shape, tp)
            width = math.prod(rest)
            chunk = math.ceil(rows / shard)
            unit_padded += chunk * width
            owned += max(0, min(chunk, rows - shard_index * chunk)) * width
            tensors += 1
        padded += unit_padded
        unit_bytes.append(unit_padded * FLOAT)
    blocks, root = unit_bytes[:-1], unit_bytes[-1]
    # Blocks are gathered for each forward and again for backward; FSDP2 keeps the root's
    # unsharded. Under a pipeline every microbatch's forward gathers the blocks, backward
    # once (torch keeps them unsharded until the stage's gradients are reduced, once).
    gathers = 2 if pp == 1 else layout["pipeline_microbatches"] + 1
    kinds: dict[str, dict[str, tuple[int, int]]] = {"dp_shard": {
        "all_gather": (gathers * len(blocks) + 1, shard * (gathers * sum(blocks) + root)),
        "reduce_scatter": (len(blocks) + 1, shard * (sum(blocks) + root)),
    }}
    if pp > 1:
        # Each microbatch's activation goes forward, and its gradient back, across the one
        # boundary; the loss is broadcast from the last stage.
        micro = layout["pipeline_microbatches"]
        activation = BATCH // micro * SEQ * DIM * FLOAT
        kinds["pp"] = {"send": (micro, micro * activation), "recv": (micro, micro * activation),
                       "broadcast": (1, FLOAT)}
    if replicate > 1:
        kinds["dp_replicate"] = {"all_reduce": (len(blocks) + 1, sum(blocks) + root)}
    if tp > 1:
        # Forward: o and down (row-wise) sum their outputs; backward: q, k, v and up
        # (column-wise) sum their input gradients. Each is one activation.
        kinds["tp"] = {"all_reduce": (6 * LAYERS, 6 * LAYERS * BATCH * SEQ * DIM * FLOAT)}
    return {"param_bytes": padded * FLOAT, "grad_bytes": padded * FLOAT,
            "optimizer_bytes": 2 * owned * FLOAT + tensors * STEP, "kinds": kinds}


@pytest.fixture(scope="module")
def planned(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("plan") / "plans.json"
    layouts = [f"{name}={json.dumps(device)}" for name, device in LAYOUTS.items()]
    check(subprocess.run(
        [sys.executable, str(REPO / "tests" / "scripts" / "plan_layouts.py"), str(out),
         *layouts, "--sizes", ",".join(map(str, SIZES))],
        env=child_env(), cwd=REPO, capture_output=True, text=True, timeout=600))
    return json.loads(out.read_text())


@pytest.mark.parametrize("layout", LAYOUTS)
def test_bytes_per_rank_equal_the_analytic_shards_at_8_64_and_1024(
        planned: dict[str, Any], layout: str) -> None:
    for world_size in SIZES:
        for rank in sorted({0, world_size - 1}):
            measured = planned[layout][str(world_size)][str(rank)]
            expected = analytic(LAYOUTS[layout], world_size, rank)
            where = f"{layout} at {world_size}, rank {rank}"
            # Bytes of storages are exact: no tolerance is needed, and none is used.
            for key in ("param_bytes", "grad_bytes", "optimizer_bytes"):
                assert measured[key] == expected[key], (where, key)
            assert measured["activation_bytes"] > 0, where


@pytest.mark.parametrize("layout", LAYOUTS)
def test_collectives_equal_the_analytic_fsdp_and_tp_volumes(
        planned: dict[str, Any], layout: str) -> None:
    for world_size in SIZES:
        for rank in sorted({0, world_size - 1}):
            measured = planned[layout][str(world_size)][str(rank)]["collective_kinds"]
            expected = analytic(LAYOUTS[layout], world_size, rank)["kinds"]
            where = f"{layout} at {world_size}, rank {rank}"
            flat = measured.pop("dp_shard_tp", None)
            if flat is not None:
                # FSDP2 x TP: the gradient norm is one all-reduce over the flattened
                # dp_shard x tp group (a few floats), not one per axis.
                assert set(flat) == {"all_reduce"} and 1 <= flat["all_reduce"]["count"] <= 3
                assert flat["all_reduce"]["bytes"] < 1024, where
            assert set(measured) == set(expected), where
            for axis, got_kinds in measured.items():
                for kind in set(got_kinds) - set(expected[axis]):
                    # Only the gradient norm's all-reduce of a few floats is not modelled.
                    assert kind == "all_reduce" and got_kinds[kind]["bytes"] < 1024, \
                        (where, axis, kind)
            for axis, kinds in expected.items():
                for kind, (count, size) in kinds.items():
                    got = measured[axis][kind]
                    if kind == "all_reduce":
                        # clip_grad_norm adds one all-reduce of the per-tensor norms per
                        # group of gradients sharded over the axis (DTensor groups them by
                        # placement): a few floats each.
                        assert count <= got["count"] <= count + 3, (where, axis, kind)
                        assert got["bytes"] == pytest.approx(size, rel=0.01), (where, axis, kind)
                    else:
                        assert (got["count"], got["bytes"]) == (count, size), (where, axis, kind)
