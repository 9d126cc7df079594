"""``dream-trainer export``: a checkpoint's weights as safetensors, per model or in the
Hugging Face layout."""

from __future__ import annotations

import argparse
import os
import re
import stat
import sys
from pathlib import Path
from typing import Any

DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
_SIZE = re.compile(r"^(\d+)\s*([KMGT]i?B)?$", re.IGNORECASE)
_UNITS = {"": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}
# Files of a pretrained directory that are weights, not configuration or tokenizer.
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".h5", ".msgpack", ".ckpt")


def add_parser(commands: Any) -> argparse.ArgumentParser:
    parser = commands.add_parser(
        "export", allow_abbrev=False,
        help="write a checkpoint's weights as safetensors (per model, or Hugging Face layout)",
        description="Consolidate a (sharded) checkpoint into safetensors, in one process. "
                    "--format safetensors: <out_dir>/<model>.safetensors with the trainer's "
                    "keys, for a plain nn.Module. --format hf: the Hugging Face layout "
                    "(model.safetensors, or shards and model.safetensors.index.json) in "
                    "out_dir, or in out_dir/<model>/ for a checkpoint of several models. "
                    "--format peft: a peft model's LoRA adapter (adapter_model.safetensors, "
                    "adapter_config.json), which needs no base weights in the checkpoint. "
                    "Everything is written inside out_dir, which must be empty unless "
                    "--overwrite is given. Either may be an object-store URL "
                    "(s3://bucket/prefix; credentials and endpoint from the AWS_* "
                    "environment).")
    parser.add_argument("checkpoint", type=_location,
                        help="a step_<N> checkpoint directory, or its URL")
    parser.add_argument("out_dir", type=_location,
                        help="where to write the weights, a directory or URL (created if "
                             "missing; must be empty unless --overwrite)")
    parser.add_argument("--overwrite", action="store_true",
                        help="export into a non-empty out_dir: the weight files of an earlier "
                             "export there are replaced, other files kept")
    parser.add_argument("--format", choices=("safetensors", "hf", "peft"),
                        default="safetensors",
                        help="one file per model (default), the Hugging Face layout, or a "
                             "peft model's LoRA adapter (adapter_model.safetensors and "
                             "adapter_config.json, as PeftModel.from_pretrained loads it)")
    parser.add_argument("--dtype", choices=tuple(DTYPES),
                        help="cast floating tensors (default: as saved)")
    parser.add_argument("--max-shard-size", type=byte_size, default=None, metavar="SIZE",
                        help="largest shard of --format hf, e.g. 5GB, 500MiB or a number of "
                             "bytes (default 5GiB)")
    parser.add_argument("--trainer", metavar="TARGET",
                        help="path/to/script.py:NAME or package.module:NAME: with --format hf, "
                             "keys are renamed by that trainer's map_exported_key")
    parser.add_argument("--config-from", type=Path, metavar="DIR",
                        help="with --format hf, copy the regular files of DIR that are not "
                             "weights (config.json, tokenizer files) next to the exported "
                             "weights, e.g. the pretrained directory the run started from; "
                             "symbolic links are skipped, never followed. Its config.json's "
                             "model_type (mixtral, qwen3_moe) also says how MoE experts, "
                             "converted or as transformers builds them, are written: one "
                             "tensor per expert, as transformers saves them")
    parser.set_defaults(run=run, takes_overrides=False)
    return parser


def byte_size(text: str) -> int:
    """An argparse type: ``5GB``, ``500MiB`` or a number of bytes."""
    match = _SIZE.match(text.strip())
    if match is None or int(match.group(1)) == 0:
        raise argparse.ArgumentTypeError(f"expected a positive size like 5GB, 500MiB or "
                                         f"1000000 (bytes), got {text!r}")
    return int(match.group(1)) * _UNITS[(match.group(2) or "").upper()]


def _location(text: str) -> Any:
    """An argparse type: a URL stays one (``Path`` would fold its ``//``)."""
    from dream_trainer.checkpoint.storage import location

    return location(text)


def run(args: argparse.Namespace, overrides: list[str]) -> int:
    import torch

    from dream_trainer.checkpoint import CheckpointError, export_checkpoint
    from dream_trainer.utils.text import printable
    from dream_trainer.weights.hf import DEFAULT_MAX_SHARD_BYTES

    hf_only = [flag for flag, value in (("--max-shard-size", args.max_shard_size),
                                        ("--trainer", args.trainer),
                                        ("--config-from", args.config_from))
               if value is not None]
    if args.format != "hf" and hf_only:
        print(f"error: {', '.join(hf_only)} only apply to --format hf", file=sys.stderr)
        return 1
    if args.config_from is not None and not args.config_from.is_dir():
        print(f"error: --config-from {args.config_from}: no such directory", file=sys.stderr)
        return 1
    map_key = None
    if args.trainer is not None:
        from dream_trainer.cli.target import load_trainer

        trainer = load_trainer(args.trainer, [])
        map_key = getattr(trainer, "map_exported_key", None)
        if map_key is None:
            print(f"error: --trainer {args.trainer}: {type(trainer).__name__} has no "
                  "map_exported_key (it is not a SetupMixin trainer)", file=sys.stderr)
            return 1
    dtype = getattr(torch, DTYPES[args.dtype]) if args.dtype else None
    try:
        if args.format == "peft":
            from dream_trainer.checkpoint.adapter_export import export_checkpoint_adapters

            written = export_checkpoint_adapters(args.checkpoint, args.out_dir, dtype,
                                                 args.overwrite)
            return _printed(written)
        model_type = _model_type(args.config_from) if args.config_from is not None else None
        written = export_checkpoint(
            args.checkpoint, args.out_dir, format=args.format,
            dtype=dtype, map_key=map_key,
            max_shard_bytes=args.max_shard_size or DEFAULT_MAX_SHARD_BYTES,
            overwrite=args.overwrite, model_type=model_type)
        for path in written.values():
            if args.config_from is not None:
                _copy_config(args.config_from, path)
    except (CheckpointError, ValueError, OSError) as exc:
        print(f"error: {printable(exc, keep=chr(10))}", file=sys.stderr)
        return 1
    return _printed(written)


def _printed(written: dict[str, Any]) -> int:
    from dream_trainer.utils.text import printable

    for model, path in written.items():
        # A model's name comes from the checkpoint's metadata: escaped, it cannot drive
        # the terminal.
        print(f"{printable(model)}: {printable(path)}")
    return 0


def _model_type(directory: Path) -> str | None:
    """The ``model_type`` of ``directory``'s ``config.json``; None without the file or key.

    Raises:
        ValueError: naming the file, if it is not a JSON object.
    """
    import json

    config = directory / "config.json"
    if not config.is_file() or config.is_symlink():
        return None
    try:
        data = json.loads(config.read_text())
    except (ValueError, RecursionError) as exc:
        raise ValueError(f"--config-from {config} is not JSON ({exc}): fix or remove it") \
            from exc
    if not isinstance(data, dict):
        raise ValueError(f"--config-from {config} is not a JSON object: fix or remove it")
    model_type = data.get("model_type")
    return model_type if isinstance(model_type, str) else None


def _copy_config(source: Path, target: Any) -> None:
    """Copy the regular files of ``source`` that are not weights into ``target`` (a
    directory or an object-store location).

    A link is skipped, with a message: it may lead out of ``source`` (to a private file),
    and what it points to is not what the user named. A link in ``target`` is replaced, not
    written through.
    """
    from dream_trainer.checkpoint.storage import storage_for

    storage = storage_for(target)
    for file in sorted(source.iterdir()):
        if file.name.endswith(_WEIGHT_SUFFIXES) or file.name.endswith(".index.json"):
            continue
        if file.is_symlink():
            print(f"skipped {file}: it is a symbolic link (to {os.readlink(file)}); "
                  "--config-from copies only regular files, copy the file it points to "
                  "yourself if you trust it", file=sys.stderr)
        elif file.is_file():
            # A private file stays private: its permissions go with it, as cp -p keeps them.
            storage.write_bytes(target / file.name, file.read_bytes(),
                                stat.S_IMODE(file.stat().st_mode))
