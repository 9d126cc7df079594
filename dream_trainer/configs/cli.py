"""Command-line overrides for any config, parsed by pydantic-settings.

A training script builds its config in code, then lets the command line change any field::

    config = apply_cli_overrides(MyConfig(project="p", group="g", experiment="e", ...))

``python train.py --training_parameters.n_epochs 3 --learning_rate 1e-3`` then changes those two
fields and keeps the rest; ``--help`` lists every field with its description and the value the
script gave it.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any, TypeVar

from pydantic import BaseModel, create_model

C = TypeVar("C", bound=BaseModel)


def apply_cli_overrides(config: C, args: Sequence[str] | None = None, *,
                        prog: str | None = None, description: str | None = None) -> C:
    """Return a copy of ``config`` with the fields named in ``args`` replaced.

    Args:
        config: The script's config; its values are the defaults shown by ``--help``.
        args: Command-line arguments; ``None`` reads ``sys.argv[1:]``. Nested fields use dots
            (``--training_parameters.n_epochs 3``); a nested model may also be given whole as
            JSON (``--training_parameters '{"n_epochs": 3, "train_batch_size": 8}'``).
        prog: Program name for the usage line; ``None`` uses the script's file name.
        description: Text shown by ``--help`` above the options.

    Returns:
        A new, fully validated config of the same class; ``config`` itself is unchanged.

    Raises:
        pydantic.ValidationError: An override is invalid; the error names the field by its
            dotted path (``training_parameters.n_epochs``).
        SystemExit: ``--help`` was given (exit code 0), or an argument is unknown or has no
            value (exit code 2, with argparse's message).
    """
    from pydantic_settings import CliSettingsSource  # imported here: only scripts that parse pay

    args = list(sys.argv[1:] if args is None else args)
    prog = prog or _script_name()
    # No abbreviations: argparse would otherwise take a misspelt ``--n_epoch`` as ``--n_epochs``.
    parser = argparse.ArgumentParser(prog=prog, description=description, allow_abbrev=False,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    source = CliSettingsSource(_with_defaults_of(config), cli_prog_name=prog, root_parser=parser,
                               cli_exit_on_error=True, cli_avoid_json=False)
    overrides = source(args=args)()  # parse, then read the parsed values as nested dicts
    if not overrides:
        return config.model_copy(deep=True)
    return type(config).model_validate(_merge(config, overrides))


def _script_name() -> str:
    from pathlib import Path

    return Path(sys.argv[0]).name if sys.argv and sys.argv[0] else "train"


def _with_defaults_of(config: BaseModel) -> type[BaseModel]:
    """A parser-only subclass whose defaults are ``config``'s values, so ``--help`` shows them.

    Nested configs get their own such subclasses. Nothing is validated against these classes:
    they only shape the argument parser.
    """
    fields: dict[str, Any] = {}
    for name, info in type(config).model_fields.items():
        value = getattr(config, name)
        annotation = info.annotation
        if isinstance(value, BaseModel) and type(value).model_fields:
            annotation = _with_defaults_of(value)
            value = annotation.model_construct(**{k: getattr(value, k)
                                                  for k in type(value).model_fields})
        fields[name] = (annotation, _field_with_default(info, value))
    return create_model(type(config).__name__, __base__=type(config), **fields)


def _field_with_default(info: Any, value: Any) -> Any:
    from pydantic import Field

    return Field(default=value, description=info.description)


def _merge(model: BaseModel, overrides: dict[str, Any]) -> dict[str, Any]:
    """``model``'s explicitly set fields with ``overrides`` laid over them, nested by field.

    Values stay the model's own objects (not dumps), so fields that do not round-trip through
    JSON (callbacks, dtypes) pass through unchanged.
    """
    merged: dict[str, Any] = {name: getattr(model, name) for name in model.model_fields_set}
    for name, value in overrides.items():
        current = getattr(model, name, None)
        if isinstance(value, dict) and isinstance(current, BaseModel):
            merged[name] = _merge(current, value)
        else:
            merged[name] = value
    return merged
