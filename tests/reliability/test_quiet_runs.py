"""A run prints nothing on stderr that is not about it: the import-time records transformers
causes (torchao's kernel loads, torch's deprecation of torchao's enum registrations) are
dropped at their loggers, and nothing else is (``dream_trainer.utils.import_noise``)."""

from __future__ import annotations

import enum
import logging
import subprocess
import sys

import pytest

from tests.helpers.launch import REPO, child_env

SCRIPT = REPO / "tests/scripts/quiet_hf_run.py"
NOISE = ("Failed to load", "_C_mxfp8", "_C_cutlass_90a", "is an Enum subclass",
         "register_constant")


def run(*args: str) -> subprocess.CompletedProcess[str]:
    result = subprocess.run([sys.executable, str(SCRIPT), *args], env=child_env(), cwd=REPO,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "trained 2 steps" in result.stdout
    return result


def test_a_transformers_run_prints_nothing_on_stderr() -> None:
    assert run().stderr == ""
    # The control: with transformers' model classes imported before dream_trainer, the
    # records were emitted before the filters existed. (If torchao stops emitting them, this
    # half fails and the filters can go.)
    control = run("--transformers-first").stderr
    assert all(noise in control for noise in NOISE), control


class Kind(enum.Enum):
    A = 1


def test_the_filters_drop_those_records_only(caplog: pytest.LogCaptureFixture) -> None:
    import dream_trainer  # noqa: F401  (installs the filters)

    caplog.set_level(logging.INFO)
    torchao = logging.getLogger("torchao")
    torchao.warning("Failed to load /x/site-packages/torchao/_C_mxfp8.cpython-310-x86_64-linux-"
                    "gnu.so: Could not load this library")
    torchao.warning("Failed to load /x/site-packages/torchao/_C_cutlass_90a.abi3.so: nope")
    torchao.warning("Failed to load /x/site-packages/torchao/_C.abi3.so: nope")
    torchao.warning("Skipping import of cpp extensions due to incompatible torch version")
    pytree = logging.getLogger("torch.utils._pytree")
    message = ("%s is an Enum subclass and is now natively supported by torch.compile as an "
               "opaque value type.")
    torchao_enum = enum.Enum("KernelPreference", "AUTO", module="torchao.quantization.enums")
    pytree.warning(message, torchao_enum)
    pytree.warning(message, Kind)
    kept = [(record.name, record.getMessage()) for record in caplog.records]
    assert kept == [
        ("torchao", "Failed to load /x/site-packages/torchao/_C.abi3.so: nope"),
        ("torchao", "Skipping import of cpp extensions due to incompatible torch version"),
        ("torch.utils._pytree", message % Kind),
    ]


def test_torchdatas_set_vital_deprecation_is_silenced_and_nothing_else() -> None:
    """A stateful loader's construction warns that torch.set_vital is deprecated, once per
    loader: silenced in a process that imported dream_trainer; other warnings still show."""
    code = ("import warnings\n"
            "{first}"
            "from torchdata.stateful_dataloader import StatefulDataLoader\n"
            "StatefulDataLoader(list(range(4)))\n"
            "warnings.warn('a warning about the run')\n")
    quiet, control = (subprocess.run([sys.executable, "-c", code.format(first=first)],
                                     env=child_env(), cwd=REPO, capture_output=True,
                                     text=True, timeout=120)
                      for first in ("import dream_trainer\n", ""))
    assert "set_vital" not in quiet.stderr and "a warning about the run" in quiet.stderr
    assert "'set_vital' is deprecated" in control.stderr
