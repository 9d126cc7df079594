"""Arguments shared by the commands that run a user's trainer."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pydantic import ValidationError


def add_target(parser: argparse.ArgumentParser) -> None:
    """Add the TARGET positional; the commands with one also take config overrides."""
    parser.add_argument("target", metavar="TARGET",
                        help="the trainer factory: path/to/script.py:NAME or package.module:NAME")
    parser.set_defaults(takes_overrides=True)


def positive_int(text: str) -> int:
    """An argparse type: an integer of at least 1."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def non_negative_int(text: str) -> int:
    """An argparse type: an integer of at least 0."""
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {value}")
    return value


def policy_overrides(policy: int | str | None, offload: bool) -> list[str]:
    """Config overrides that set ``activation_checkpointing`` and ``activation_offload``
    (after the user's, so that they win)."""
    return ["--device_parameters.activation_checkpointing",
            "null" if policy is None else str(policy),
            "--device_parameters.activation_offload", "true" if offload else "false"]


def refusal(exc: ValidationError) -> str:
    """A config's refusal of a setting in one line: ``refused: <each error's message>``."""
    return "refused: " + "; ".join(str(error["msg"]).removeprefix("Value error, ")
                                   for error in exc.errors())
