"""A checkpoint written under any layout resumes under others, on 1, 2 or 4 ranks.

Nine layouts (one process; DDP, FSDP2, TP, a 2-stage pipeline and context parallelism on 2
ranks; HSDP, FSDP2 x TP and a pipeline of FSDP2 stages on 4) train the tiny transformer and
checkpoint at step 2; each checkpoint is resumed under two other layouts, changing the number
of processes from 1 to 2 and 4, from 2 to 1 and 4, and from 4 to 2 and 1, and trained to step
4. Three torchrun
launches run them all, and the one-process jobs run in this process, before and after them
(see ``LAUNCHES`` and tests/scripts/layout_matrix.py).

Right after loading, the full model, optimizer and EMA state equals what the source held when
it saved, bit for bit. The resumed run then ends where one uninterrupted process of the same
4 steps ends (the "single" source run), within ``ULPS`` float32 ulps of each tensor's scale
(the momenta: of the largest one's): data- and tensor-parallel layouts add partial gradients
in another order than one process does, which moves float32 results by ~1e-7 over these steps
(momentum and the EMA carry it along); a step trained on the wrong samples or a lost momentum
moves them by ~1e-3.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import pytest
import torch

from dream_trainer.checkpoint.rng import rng_state, set_rng_state
from tests.helpers.launch import REPO, check, torchrun
from tests.helpers.tolerance import assert_close_to_scale, assert_tensors_close_to_scale
from tests.scripts.layout_matrix import GLOBAL_BATCH, LAYOUTS, SAVE_STEP, STEPS, run

pytestmark = pytest.mark.distributed

SCRIPT = REPO / "tests/scripts/layout_matrix.py"
REFERENCE = "save:single"
ULPS = 16

LAUNCHES: list[tuple[int, list[str]]] = [
    # (processes, jobs), in order: a job resumes only checkpoints written before it.
    (1, ["save:single"]),
    (2, ["save:ddp", "save:fsdp", "save:tp", "save:pp", "save:cp",
         "resume:single:ddp", "resume:fsdp:tp", "resume:tp:fsdp", "resume:single:cp"]),
    (4, ["save:hsdp", "save:fsdp_tp", "save:pp_fsdp",
         "resume:single:fsdp_tp", "resume:ddp:hsdp", "resume:pp:pp_fsdp"]),
    (2, ["resume:hsdp:fsdp", "resume:fsdp_tp:pp", "resume:pp_fsdp:ddp", "resume:cp:fsdp"]),
    (1, [f"resume:{source}:single"
         for source in ("ddp", "fsdp", "tp", "pp", "hsdp", "fsdp_tp", "pp_fsdp", "cp")]),
]
RESUMES = [tuple(job.split(":")[1:]) for _, jobs in LAUNCHES for job in jobs
           if job.startswith("resume:")]


def processes(layout: str) -> int:
    return LAYOUTS[layout][2]


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    work = tmp_path_factory.mktemp("matrix")
    merged: dict[str, dict[str, Any]] = {}
    for index, (nproc, jobs) in enumerate(LAUNCHES):
        if nproc == 1:  # saves starting a process (~5 s of imports); the seeding is undone
            generators = rng_state()
            try:
                merged.update({job: run(job, work) for job in jobs})
            finally:
                set_rng_state(generators)
            continue
        out = work / f"launch{index}.pt"
        check(torchrun(SCRIPT, [str(work), str(out), *jobs], nproc=nproc, timeout=400))
        merged.update(torch.load(out))
    return merged


def test_the_matrix_resumes_every_layout_twice_and_changes_size_both_ways() -> None:
    for nproc, jobs in LAUNCHES:
        for job in jobs:  # a job's last field is the layout it runs under
            assert processes(job.split(":")[-1]) == nproc, job
    for layout in LAYOUTS:
        assert len({target for source, target in RESUMES if source == layout}) >= 2, layout
    sizes = {(processes(source), processes(target)) for source, target in RESUMES}
    assert sizes >= {(1, 2), (1, 4), (2, 1), (2, 4), (4, 2), (4, 1)}


def assert_tensors(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor],
                   ulps: float | None = None) -> None:
    """Equal bit for bit (``ulps=None``), else within ``ulps`` of each tensor's scale."""
    assert actual.keys() == expected.keys() and expected
    for name, tensor in expected.items():
        if ulps is None:
            assert torch.equal(actual[name], tensor), name
        else:
            assert_close_to_scale(actual[name], tensor, ulps=ulps, msg=name)


@pytest.mark.parametrize(("source", "target"), RESUMES)
def test_resume_loads_exactly_what_the_source_saved(results: dict[str, Any], source: str,
                                                    target: str) -> None:
    saved = results[f"save:{source}"]["saved"]
    loaded = results[f"resume:{source}:{target}"]["loaded"]
    for kind in ("weights", "momenta", "ema"):
        assert_tensors(loaded[kind], saved[kind])
    for key in ("lr", "scheduler", "global_step", "epoch", "ema_updates"):
        assert loaded[key] == saved[key], key
    assert loaded["global_step"] == loaded["ema_updates"] == SAVE_STEP
    # Not vacuous: momenta were built up, and the averages lag the weights.
    assert all(momentum.abs().max() > 0 for momentum in saved["momenta"].values())
    assert not torch.equal(saved["ema"]["model.head.weight"], saved["weights"]["head.weight"])


def assert_trained_like_reference(final: dict[str, Any], reference: dict[str, Any]) -> None:
    for kind in ("weights", "ema"):
        assert_tensors(final[kind], reference[kind], ulps=ULPS)
    # Momenta at the scale of the largest: the key bias's gradient is zero but for rounding
    # (softmax ignores a shift of every key by one vector), its momentum ~5e-10.
    assert_tensors_close_to_scale(final["momenta"], reference["momenta"], ulps=ULPS,
                                  shared_scale=True)
    for key in ("lr", "scheduler", "global_step", "epoch", "ema_updates"):
        assert final[key] == reference[key], key
    assert final["global_step"] == final["ema_updates"] == STEPS


@pytest.mark.parametrize(("source", "target"), RESUMES)
def test_resumed_run_ends_as_one_uninterrupted_process(results: dict[str, Any], source: str,
                                                       target: str) -> None:
    reference = results[REFERENCE]["final"]
    assert_trained_like_reference(results[f"resume:{source}:{target}"]["final"], reference)
    # Not vacuous: the steps after the resume moved the weights far beyond the tolerance.
    saved = results[f"save:{source}"]["saved"]["weights"]["head.weight"]
    assert (reference["weights"]["head.weight"] - saved).abs().max() > 1e-3


@pytest.mark.parametrize("layout", [layout for layout in LAYOUTS if layout != "single"])
def test_every_source_layout_trains_as_one_process(results: dict[str, Any],
                                                   layout: str) -> None:
    assert_trained_like_reference(results[f"save:{layout}"]["final"],
                                  results[REFERENCE]["final"])


Samples = list[tuple[int, list[tuple[int, list[int]]]]]
"""Each rank's ``(data shard, [(step, sample ids)])``."""


def global_batches(samples: Samples) -> dict[int, list[int]]:
    """Every step's sample ids over all data shards (sorted); the ranks of one shard
    (tensor-parallel peers, pipeline stages) must have read alike."""
    by_shard: dict[int, list[tuple[int, list[int]]]] = {}
    for shard, steps in samples:
        assert by_shard.setdefault(shard, steps) == steps, f"shard {shard} read differently"
    batches: dict[int, list[int]] = defaultdict(list)
    for steps in by_shard.values():
        for step, ids in steps:
            batches[step] += ids
    return {step: sorted(ids) for step, ids in batches.items()}


@pytest.mark.parametrize(("source", "target"), RESUMES)
def test_resumed_run_reads_exactly_the_unseen_samples(results: dict[str, Any], source: str,
                                                      target: str) -> None:
    before = {step: ids for step, ids in global_batches(results[f"save:{source}"]["samples"])
              .items() if step <= SAVE_STEP}
    after = global_batches(results[f"resume:{source}:{target}"]["samples"])
    assert sorted(before) == list(range(1, SAVE_STEP + 1))
    assert sorted(after) == list(range(SAVE_STEP + 1, STEPS + 1))
    # Each step's batch is the uninterrupted run's, so no sample is repeated or skipped.
    assert {**before, **after} == global_batches(results[REFERENCE]["samples"])
    read = [i for ids in [*before.values(), *after.values()] for i in ids]
    assert len(read) == len(set(read)) == STEPS * GLOBAL_BATCH


def rng_warnings(result: dict[str, Any]) -> list[tuple[int, str]]:
    return [(rank, message) for rank, messages in enumerate(result["warnings"])
            for message in messages if "random generator" in message]


@pytest.mark.parametrize(("source", "target"), RESUMES)
def test_a_world_size_change_logs_one_random_generator_warning(results: dict[str, Any],
                                                               source: str,
                                                               target: str) -> None:
    warnings = rng_warnings(results[f"resume:{source}:{target}"])
    saved, now = processes(source), processes(target)
    if saved == now:
        assert warnings == []
        return
    [(rank, message)] = warnings
    assert rank == 0 and "\n" not in message
    assert f"written by {saved} process" in message and f"this run has {now}," in message
    assert ("none were saved" if now > saved else "are unused") in message


def test_a_fresh_run_logs_no_random_generator_warning(results: dict[str, Any]) -> None:
    for layout in LAYOUTS:
        assert rng_warnings(results[f"save:{layout}"]) == []
