"""The value of ``DeviceParameters.activation_checkpointing``: which activations a training
step recomputes in backward instead of keeping them from forward."""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any, Literal

from pydantic import PlainSerializer, PlainValidator, WithJsonSchema

POLICY_NAMES: tuple[str, ...] = ("full", "selective")
"""The named policies: every block recomputed whole; every block recomputed but for the
outputs of its matrix products, attention and collectives."""

PolicyFunction = Callable[..., Any]
"""torch's selective-checkpoint policy: called as ``policy(ctx, op, *args, **kwargs)`` for
every operation a checkpointed block runs in forward; returns a
``torch.utils.checkpoint.CheckpointPolicy`` (``MUST_SAVE``/``PREFER_SAVE`` keep the op's
output, ``MUST_RECOMPUTE``/``PREFER_RECOMPUTE`` recompute it) or a bool (True keeps it).
torch 2.13 replays its choices when backward recomputes; earlier releases call it again
with ``ctx.is_recompute=True``, so it must choose alike for the same operations."""

CheckpointingPolicy = Literal["full", "selective"] | int | PolicyFunction | None
"""A policy as the code reads it, once validated: None (keep every activation), a name, an
int N >= 1 (recompute blocks 0, N, 2N, ... whole) or a ``PolicyFunction``."""

ACCEPTED = ("None (keep every activation), 'full' (recompute every block), 'selective' "
            "(recompute every block but the outputs of its matrix products, attention and "
            "collectives), an int N >= 1 (recompute blocks 0, N, 2N, ...) or a policy "
            "function policy(ctx, op, *args, **kwargs) -> torch.utils.checkpoint."
            "CheckpointPolicy")
"""What ``activation_checkpointing`` accepts, as every error about it states it."""


def parse_policy(value: Any) -> CheckpointingPolicy:
    """``value`` as a policy; a string of digits (a command-line override) as its int.

    Raises:
        ValueError: naming the field and ``ACCEPTED``, if ``value`` is none of them.
    """
    if value is None or isinstance(value, str) and value in POLICY_NAMES:
        return value
    if isinstance(value, str) and value.isdecimal():
        value = int(value)
    if isinstance(value, bool):  # an int to Python, but True would read as "every block"
        raise ValueError(f"activation_checkpointing={value!r} is not a policy (for the boolean, "
                         f"set checkpoint_activations): use {ACCEPTED}")
    if isinstance(value, int):
        if value < 1:
            raise ValueError(f"activation_checkpointing={value} recomputes every N-th block, "
                             f"which needs N >= 1: use {ACCEPTED}")
        return value
    if isinstance(value, str):
        raise ValueError(f"activation_checkpointing={value!r} is not a policy name: use "
                         f"{ACCEPTED}")
    if callable(value):
        return value
    raise ValueError(f"activation_checkpointing is a {type(value).__name__}, which is not "
                     f"callable: use {ACCEPTED}")


def policy_label(policy: CheckpointingPolicy) -> str | int | None:
    """The policy as JSON and reports show it: a policy function by its qualified name."""
    if policy is None or isinstance(policy, str | int):
        return policy
    name = getattr(policy, "__qualname__", None) or type(policy).__qualname__
    return f"{getattr(policy, '__module__', None) or '?'}.{name}"


ActivationCheckpointing = Annotated[
    CheckpointingPolicy,
    PlainValidator(parse_policy),
    # A function is written by name, for the record: a config that holds one is given in
    # code, and its JSON is not read back into a config.
    PlainSerializer(policy_label),
    WithJsonSchema({"anyOf": [{"type": "null"}, {"enum": list(POLICY_NAMES)},
                              {"type": "integer", "minimum": 1},
                              {"type": "string", "description": "a policy function's name"}]}),
]
"""``activation_checkpointing``'s type: a ``CheckpointingPolicy``, checked by
``parse_policy``."""
