"""Arguments shared by the commands that run a user's trainer."""

from __future__ import annotations

import argparse


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
