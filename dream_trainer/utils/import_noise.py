"""Log records that other libraries emit while they are imported, say nothing about the run,
and are filtered at the logger that emits them (installed by ``import dream_trainer``).

Each filter drops one known message and nothing else from its logger:

- torchao logs ``Failed to load .../torchao/_C_mxfp8...so`` and ``.../_C_cutlass_90a...so``
  at WARNING when its optional CUDA kernels (MX formats, Hopper's CUTLASS kernels) cannot
  load, which is always the case with a CPU build of torch. transformers imports torchao
  whenever it is installed (its quantizers), so every run of a transformers model printed
  them; dream_trainer's float8 training uses neither kernel (it runs on
  ``torch._scaled_mm``).
- torchao registers its enums with ``torch.utils._pytree.register_constant``, which torch
  2.13 logs as deprecated for enum classes: a note to torchao's developers.
- torchdata's ``StatefulDataLoader`` calls ``torch.set_vital``, which torch 2.13 warns is
  deprecated (a ``UserWarning`` at each loader's construction): a note to torchdata's
  developers, printed by every run with a stateful loader.

The records of a library imported before ``dream_trainer`` (``import transformers`` first in
a script) were emitted already: import dream_trainer first to silence them too.
"""

from __future__ import annotations

import logging
import re
import warnings
from collections.abc import Callable

_TORCHAO_KERNELS = re.compile(r"^Failed to load .*torchao[/\\]_C_(mxfp8|cutlass_\w+)\..*\.so\b")


def _is_torchao_kernel_load(record: logging.LogRecord) -> bool:
    return bool(_TORCHAO_KERNELS.match(record.getMessage()))


def _is_torchao_enum_registration(record: logging.LogRecord) -> bool:
    args = record.args if isinstance(record.args, tuple) else ()
    return "is an Enum subclass" in str(record.msg) and len(args) == 1 \
        and getattr(args[0], "__module__", "").startswith("torchao.")


class _Drop(logging.Filter):
    """Drops the records ``matches`` selects."""

    def __init__(self, matches: Callable[[logging.LogRecord], bool]) -> None:
        super().__init__()
        self.matches = matches

    def filter(self, record: logging.LogRecord) -> bool:
        return not self.matches(record)


FILTERS: dict[str, logging.Filter] = {
    "torchao": _Drop(_is_torchao_kernel_load),
    "torch.utils._pytree": _Drop(_is_torchao_enum_registration),
}
"""The logger each filter is installed on (records of child loggers do not pass through a
parent's filters, so these are the emitting loggers themselves)."""


def install() -> None:
    """Install the filters (again is a no-op): it imports none of the libraries."""
    for name, record_filter in FILTERS.items():
        logger = logging.getLogger(name)
        if record_filter not in logger.filters:
            logger.addFilter(record_filter)
    # Raised in torchdata's module (the warning's stack level): only its call is silenced.
    warnings.filterwarnings("ignore", message="'set_vital' is deprecated",
                            category=UserWarning, module=r"torchdata\.")
