"""``init_weights_from`` for peft models: the base model's Hugging Face directory and peft's
adapter folders, read into the keys of the wrapped model.

peft renames what it wraps: the base's ``model.layers.0.self_attn.q_proj.weight`` becomes
``base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight``, and an adapter folder
(``adapter_model.safetensors`` and ``adapter_config.json``, as ``save_pretrained`` writes
it) keys the adapters without their name (``...q_proj.lora_A.weight`` for the model's
``...q_proj.lora_A.default.weight``). ``PeftKeys`` maps both kinds of files onto a model's
state keys, so a base directory loads into a peft model as it loads into the bare one and a
saved adapter continues a fine-tune. The models are recognized by their keys: this works on
a pipeline's stages as on the whole model, and never imports peft.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Iterable
from typing import Any

from torch import nn

from dream_trainer.errors import CheckpointError
from dream_trainer.utils.bounded import read_bounded
from dream_trainer.weights.keys import KeyMap, TransformedKey

ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
PREFIX = "base_model.model."
"""What ``PeftModel`` puts before the base model's keys."""
ADAPTER_PART = re.compile(r"\.(lora_[A-Za-z_]+)\.([^.]+)(?=\.|$)")
"""``...q_proj.lora_A.<adapter>.weight``: the adapter's name after a LoRA part's."""
MATCHING = ("peft_type", "r", "lora_alpha", "use_rslora", "use_dora", "target_modules",
            "fan_in_fan_out")
"""The adapter settings that give the saved tensors their meaning: an adapter saved with
others would load and compute something else (another scaling, other layers)."""


def is_adapter_dir(path: Any, files: Any) -> bool:
    """Whether ``path`` holds a peft adapter as ``save_pretrained`` writes it."""
    return files.is_file(path / ADAPTER_WEIGHTS) and files.is_file(path / ADAPTER_CONFIG)


def is_adapter_key(key: str) -> bool:
    """Whether the model key ``key`` is a LoRA adapter's tensor (``...lora_A.default...``)."""
    return ADAPTER_PART.search(key) is not None


class PeftKeys:
    """The model keys of a peft model's files, from the model's own state keys.

    Args:
        keys: The model's state keys (wrapper segments removed).
    """

    def __init__(self, keys: Iterable[str]) -> None:
        self.keys = set(keys)
        self.base: dict[str, str] = {}
        self.adapters: dict[str, dict[str, str]] = {}
        for key in self.keys:
            match = ADAPTER_PART.search(key)
            if match is not None:
                saved = key[:match.start(2) - 1] + key[match.end(2):]
                self.adapters.setdefault(match.group(2), {})[saved] = key
            elif key.startswith(PREFIX) or ".base_layer." in key:
                self.base[key.removeprefix(PREFIX).replace(".base_layer.", ".")] = key

    @property
    def is_peft(self) -> bool:
        return bool(self.adapters) or bool(self.base)

    def base_key(self, key: str) -> str:
        """The model key for ``key`` of the base model's files (a key the model has as it
        is stays)."""
        return key if key in self.keys else self.base.get(key, key)

    def adapter_key(self, key: str) -> str:
        """The model key for ``key`` of an adapter folder: the one adapter's tensor.

        Raises:
            CheckpointError: for a model with several adapters (which would it continue?).
        """
        if len(self.adapters) > 1:
            raise CheckpointError(
                f"the model holds the adapters {sorted(self.adapters)}; an adapter folder "
                "continues one of them: delete the others (model.delete_adapter) before "
                "loading it with init_weights_from")
        (mapping,) = self.adapters.values() if self.adapters else ({},)
        return mapping.get(key, key)


def peft_key_map(keys: Iterable[str], map_key: KeyMap, adapter: bool) -> KeyMap:
    """``map_key`` followed by peft's renaming for a model whose state keys are ``keys``: a
    base's file keys to the wrapped base layers', an adapter folder's (``adapter``) to the
    adapter's; ``map_key`` itself for a model that is not a peft model."""
    peft = PeftKeys(keys)
    if adapter:
        return lambda name, key: peft.adapter_key(key)
    if not peft.is_peft:
        return map_key

    def mapped(name: str, key: str) -> str | TransformedKey | None:
        answer = map_key(name, key)
        if isinstance(answer, TransformedKey):
            return dataclasses.replace(answer, key=peft.base_key(answer.key))
        return None if answer is None else peft.base_key(answer)

    return mapped


def check_adapter_config(path: Any, files: Any, model: nn.Module) -> None:
    """Refuse an adapter folder saved with other settings than the model's adapter.

    Raises:
        CheckpointError: naming ``adapter_config.json`` and each setting that differs, or
            the file when it is not a JSON object.
    """
    file = path / ADAPTER_CONFIG
    try:
        with files.open_file(file) as handle:
            saved = json.loads(read_bounded(handle, file))
        if not isinstance(saved, dict):
            raise ValueError(f"a JSON {type(saved).__name__}, not an object")
    except (OSError, ValueError, RecursionError) as exc:
        raise CheckpointError(f"{file} cannot be read as an adapter config ({exc}): save the "
                              "adapter again with save_pretrained") from exc
    configs = [config for module in model.modules()
               if isinstance(held := getattr(module, "peft_config", None), dict)
               for config in held.values()]
    if not configs:
        return  # a pipeline stage may hold no PeftModel; the keys still have to fit
    live = configs[0].to_dict()
    differing = [f"{name} {_plain(saved.get(name))!r} (the model's {_plain(live.get(name))!r})"
                 for name in MATCHING if _plain(saved.get(name)) != _plain(live.get(name))]
    if differing:
        raise CheckpointError(
            f"{file} was saved for another adapter: {'; '.join(differing)}. Build the model's "
            "LoraConfig with the folder's settings (LoraConfig.from_pretrained(folder)), or "
            "start the adapter fresh")


def _plain(value: Any) -> Any:
    """JSON's view of a config value (sets and tuples as sorted lists, enums by value)."""
    if isinstance(value, (set, list, tuple)):
        return sorted(map(str, value))
    return getattr(value, "value", value)


def config_json(values: dict[str, Any]) -> bytes:
    """An adapter config (``LoraConfig.to_dict()``) as ``adapter_config.json`` holds it."""
    return json.dumps(values, indent=2, sort_keys=True, default=json_value).encode()


def json_value(value: Any) -> Any:
    """A config value JSON lacks: sets as sorted lists, enums by value, anything else as its
    text (writing a record never fails on a value)."""
    if isinstance(value, (set, frozenset)):
        return sorted(map(str, value))
    return getattr(value, "value", str(value))
