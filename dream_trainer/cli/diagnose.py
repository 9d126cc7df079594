"""``dream-trainer diagnose``: the hang verdict from the records HangWatchdog wrote."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from dream_trainer.callbacks.hang_report import read_records, verdict
from dream_trainer.utils.text import printable


def add_parser(commands: Any) -> argparse.ArgumentParser:
    parser = commands.add_parser(
        "diagnose", allow_abbrev=False,
        help="say which rank and collective a hung run stopped at",
        description="Read the hang_rank<R>.json records that HangWatchdog wrote when it ended "
                    "a hung run (its trace_dir) and print the verdict: which ranks were "
                    "behind, the first collective they never entered (sequence number and "
                    "mesh axis), and the frame each rank was in. A file that is not such a "
                    "record is named as an error (exit code 1).")
    parser.add_argument("run_dir", type=Path, metavar="RUN_DIR",
                        help="the directory with the records (HangWatchdog's trace_dir)")
    parser.set_defaults(run=run, takes_overrides=False)
    return parser


def run(args: argparse.Namespace, overrides: list[str]) -> int:
    try:
        records = read_records(args.run_dir)
    except (FileNotFoundError, ValueError) as exc:  # the message names the file and the fix
        # The message quotes file names and values from the records: escaped, they cannot
        # drive the terminal.
        print(f"dream-trainer diagnose: error: {printable(exc, keep=chr(10))}",
              file=sys.stderr)
        return 1
    print(verdict(records))  # escapes what it quotes from the records
    return 0
