"""TARGET: the user's trainer factory, ``script.py:NAME`` or ``package.module:NAME``."""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import inspect
import sys
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

from dream_trainer.errors import TargetError
from dream_trainer.trainer.base import BaseTrainer

FORM = ("expected path/to/script.py:NAME or package.module:NAME, where NAME() returns an "
        "unfitted trainer")


def load_trainer(target: str, overrides: Sequence[str]) -> BaseTrainer:
    """Import the factory that ``target`` names and call it to get a trainer.

    A factory that can take one positional argument gets the override arguments (a list,
    empty when there are none, never ``None``: ``apply_cli_overrides(config, None)`` would read
    this command's own ``sys.argv``); one that takes none gets no overrides.

    Args:
        target: ``path/to/script.py:NAME`` or ``package.module:NAME``.
        overrides: Config override arguments for the factory (``--training_parameters.n_epochs 3``).

    Returns:
        The trainer the factory returned.

    Raises:
        TargetError: if the file, module or attribute is missing, the attribute is not a
            factory, or it returned something other than a trainer.
    """
    location, _, name = target.rpartition(":")
    if not location or not name.isidentifier():
        raise TargetError(f"{target!r} names no factory: {FORM}")
    module = _load_module(location)
    if not hasattr(module, name):
        raise TargetError(f"{location} has no attribute {name!r}: {FORM}")
    factory = getattr(module, name)
    if isinstance(factory, type) and issubclass(factory, BaseTrainer):
        raise TargetError(f"{name} is a trainer class, not a factory: point at a function "
                          f"that builds its config and returns {name}(config); {FORM}")
    if not callable(factory):
        raise TargetError(f"{location}:{name} is not callable (type "
                          f"{type(factory).__name__}): {FORM}")
    with _program_name(location):
        trainer = _call(factory, name, list(overrides))
    if not isinstance(trainer, BaseTrainer):
        raise TargetError(f"{name}() returned {type(trainer).__name__}, not a trainer (an "
                          f"instance of a dream_trainer BaseTrainer subclass): {FORM}")
    return trainer


def _load_module(location: str) -> ModuleType:
    if location.endswith(".py") or "/" in location or "\\" in location:
        return _load_file(Path(location))
    # `python -m` puts the working directory on the path, the console script does not.
    if "" not in sys.path and str(Path.cwd()) not in sys.path:
        sys.path.insert(0, str(Path.cwd()))
    try:
        return importlib.import_module(location)
    except ModuleNotFoundError as exc:
        # Only the target itself being absent is a bad TARGET; a module that fails to import
        # one of its own dependencies is the user's error, shown with its traceback.
        if exc.name is not None and (location == exc.name or location.startswith(f"{exc.name}.")):
            raise TargetError(f"no module named {exc.name!r}: {FORM}") from None
        raise


def _load_file(path: Path) -> ModuleType:
    """Execute a script as a module named after it, so its ``__main__`` block does not run."""
    if not path.is_file():
        raise TargetError(f"no such file: {path}: {FORM}")
    path = path.resolve()
    module_name = f"dream_trainer_target_{path.stem}"
    spec = importlib.util.spec_from_file_location(module_name, path)
    if spec is None or spec.loader is None:
        raise TargetError(f"{path} cannot be loaded as Python: {FORM}")
    module = importlib.util.module_from_spec(spec)
    # Registered before it runs: pydantic and dataclasses look their module up by name.
    sys.modules[module_name] = module
    # As `python script.py` would, so the script can import the modules beside it.
    if str(path.parent) not in sys.path:
        sys.path.insert(0, str(path.parent))
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[module_name]
        raise
    return module


def _call(factory: Callable[..., Any], name: str, overrides: list[str]) -> Any:
    try:
        signature = inspect.signature(factory)
    except (TypeError, ValueError):  # some builtins have no signature: try the one-argument form
        return factory(overrides)
    if _binds(signature, overrides):
        return factory(overrides)
    if not _binds(signature):
        raise TargetError(f"{name}{signature} cannot be called with no arguments or with one "
                          f"(the list of config overrides): {FORM}")
    if overrides:
        raise TargetError(
            f"{name}() takes no arguments, so the overrides {' '.join(overrides)!r} cannot be "
            f"applied: define it as {name}(args=None) and pass args to apply_cli_overrides"
        )
    return factory()


def _binds(signature: inspect.Signature, *args: Any) -> bool:
    try:
        signature.bind(*args)
    except TypeError:
        return False
    return True


@contextlib.contextmanager
def _program_name(location: str) -> Iterator[None]:
    """Show the script (or module) as the program in the factory's ``--help`` and errors."""
    saved = sys.argv[:]
    sys.argv[:1] = [location]
    try:
        yield
    finally:
        sys.argv[:] = saved
