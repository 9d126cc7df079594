"""Suite-wide guards: no test may leak a process group or launcher variables."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
               "MASTER_PORT")

torch.set_num_threads(1)

# Inductor's on-disk cache does not key its compiled kernels by ATen's CPU capability: a
# suite run under ATEN_CPU_CAPABILITY=default after one under avx2 (or the machine's own)
# reused kernels built for the other and failed to compile or trained to NaN. A run that
# sets the capability gets a cache of its own (its launched ranks inherit it).
_capability = os.environ.get("ATEN_CPU_CAPABILITY")
if _capability and "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
    import getpass
    import tempfile

    os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(
        tempfile.gettempdir(), f"torchinductor_{getpass.getuser()}_{_capability}")


# The longest files first: make test hands files to its two workers in collection order, and a
# long file handed out last keeps one worker busy while the other has nothing left to do.
SLOWEST_FIRST = (
    "tests/parallel/test_pipeline_parallel.py", "tests/benchmarks/test_harness.py",
    "tests/checkpoint/test_layout_matrix.py", "tests/checkpoint/test_kill_and_resume.py",
    "tests/parallel/test_hf_pipeline.py", "tests/parallel/test_float8.py",
    "tests/mixins/test_fault_tolerance.py", "tests/examples/test_examples.py",
    "tests/data/test_streaming.py", "tests/data/test_sharded_stream_resume.py",
    "tests/nn/test_moe_resume.py", "tests/examples/test_large_model_examples.py",
    "tests/parallel/test_context_parallel.py", "tests/nn/test_moe_combos.py",
    "tests/checkpoint/s3/test_object_store_runs.py", "tests/nn/test_grouped_experts.py",
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    order = {path: index for index, path in enumerate(SLOWEST_FIRST)}
    root = config.rootpath
    items.sort(key=lambda item: order.get(item.path.relative_to(root).as_posix(), len(order)))


@pytest.fixture(autouse=True)
def _no_leaks() -> Iterator[None]:
    env_before = {name: os.environ.get(name) for name in LAUNCH_VARS}
    assert not dist.is_initialized(), "a previous test leaked a process group"
    yield
    leaked_group = dist.is_initialized()
    if leaked_group:
        dist.destroy_process_group()
    changed = {name for name in LAUNCH_VARS if os.environ.get(name) != env_before[name]}
    for name in changed:
        if env_before[name] is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = env_before[name]  # type: ignore[assignment]
    assert not leaked_group, "the test left a process group initialized"
    assert not changed, f"the test changed launcher variables: {sorted(changed)}"


@pytest.fixture
def private_tempdir(tmp_path_factory: pytest.TempPathFactory,
                    monkeypatch: pytest.MonkeyPatch) -> Path:
    """A temporary directory of the test's own as ``tempfile``'s default, for tests that
    check what a command leaves there: ``/tmp`` is shared with whatever else runs on the
    machine (another test worker's or a user's command creates and deletes its own
    sandboxes there at any time)."""
    import tempfile

    directory = tmp_path_factory.mktemp("tempdir")
    monkeypatch.setattr(tempfile, "tempdir", str(directory))
    return directory


@pytest.fixture
def restore_imports(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """For tests that load a trainer from a file (the CLI's SCRIPT:FACTORY): loading puts the
    file's directory on sys.path and its module in sys.modules; both are undone."""
    import sys

    monkeypatch.setattr(sys, "path", list(sys.path))
    before = set(sys.modules)
    yield
    for name in set(sys.modules) - before:
        if name.startswith("dream_trainer_target_"):
            del sys.modules[name]
