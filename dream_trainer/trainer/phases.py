"""A mixin's own work at a lifecycle point, run whether or not user code calls ``super()``.

A mixin marks the methods that do its essential work (resume, the run lock, logging, the final
checkpoint) with ``@runs_on(hook)``. The trainer runs them itself around the trainer's public
hook of the same name, so a user's ``post_setup`` that forgets ``super().post_setup()`` cannot
switch a mixin off. The public hooks on ``TrainerHooks`` stay empty: they belong to users.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any, TypeVar

from pydantic import BaseModel

from dream_trainer.trainer.hooks import HOOK_NAMES, TrainerHooks

logger = logging.getLogger(__name__)

PHASES: tuple[str, ...] = (*HOOK_NAMES, "end_of_step", "end_of_validation_set", "teardown")
"""Where mixin work can run: every lifecycle hook, the end of an optimizer step, the end of a
validation set, and teardown."""

CLOSING_PHASES: frozenset[str] = frozenset({"post_fit", "on_exception"})
"""Phases whose mixin work runs after the trainer's public hook instead of before it: it closes
things (the logger's run, the final checkpoint), and a user's ``post_fit`` may still evaluate,
log or change what the final checkpoint holds."""

_MARK = "__dream_phase__"
F = TypeVar("F", bound=Callable[..., None])


def runs_on(phase: str, *, after_bases: bool = False) -> Callable[[F], F]:
    """Mark a mixin method as work the trainer runs at ``phase``, with the hook's arguments.

    Handlers run in the trainer's method resolution order, each class's before those of the
    classes it derives from, as a chain of ``super()`` calls placed last would run them;
    ``after_bases=True`` runs a handler after its bases' handlers instead, as a ``super()``
    call placed first would. All of them run before the trainer's public hook (after it for
    ``CLOSING_PHASES``), and before the callbacks.

    Raises:
        ValueError: if ``phase`` is not a lifecycle hook or one of ``PHASES``.
    """
    if phase not in PHASES:
        raise ValueError(f"runs_on({phase!r}): not a phase; phases are {PHASES}")

    def mark(method: F) -> F:
        setattr(method, _MARK, (phase, after_bases))
        return method

    return mark


@functools.cache
def handlers(cls: type, phase: str) -> tuple[str, ...]:
    """The names of ``cls``'s methods marked for ``phase``, in the order they run."""
    first: list[str] = []
    last: list[str] = []
    for klass in cls.__mro__:
        for name, value in vars(klass).items():
            mark = getattr(value, _MARK, None)
            if mark is not None and mark[0] == phase:
                (last if mark[1] else first).append(name)
    ordered = first + last[::-1]
    return tuple(dict.fromkeys(ordered))  # a name redefined lower in the MRO runs once


@functools.cache
def phase_calls(cls: type, phase: str) -> tuple[str, ...]:
    """The names of the methods ``cls`` runs at ``phase``, in order: its handlers, then its
    public method of that name (first for ``CLOSING_PHASES``). A public hook ``cls`` leaves as
    ``TrainerHooks``' no-op is left out: a hook nobody overrides costs nothing per step."""
    own = () if getattr(cls, phase) is getattr(TrainerHooks, phase, None) else (phase,)
    work = handlers(cls, phase)
    return own + work if phase in CLOSING_PHASES else work + own


def run_phase_to_the_end(trainer: object, phase: str) -> None:
    """Run every handler of ``phase`` even when some raise (teardown: each handler releases
    its own resource); then raise the first error."""
    first_error: BaseException | None = None
    for name in handlers(type(trainer), phase):
        try:
            getattr(trainer, name)()
        except BaseException as exc:  # noqa: BLE001 - re-raised below, after the others ran
            first_error = first_error or exc
            logger.error("teardown step %s failed: %s: %s", name, type(exc).__name__, exc)
    if first_error is not None:
        raise first_error


# -- methods whose overrides must call super() ---------------------------------------------------
def chain_base(method: F) -> F:
    """Mark the base implementation of a method whose overrides call ``super()`` (teardown, the
    state methods), so that ``call_through`` can tell when an override skipped it."""

    @functools.wraps(method)
    def base(self: Any, *args: Any) -> Any:
        vars(self).setdefault("_dream_chain_reached", set()).add(method.__name__)
        return method(self, *args)

    return base  # type: ignore[return-value]


def call_through(trainer: object, name: str, *args: Any) -> Any:
    """``getattr(trainer, name)(*args)``, then the part of the chain an override skipped.

    When the most derived override did not reach the base (it forgot ``super()``), the
    implementations below it run anyway, after it, and an error is logged naming the override;
    dict results are merged, the override's entries winning. Mixins' state and resources are
    therefore never lost to a missing ``super()``.
    """
    reached: set[str] = vars(trainer).setdefault("_dream_chain_reached", set())
    reached.discard(name)
    result = getattr(trainer, name)(*args)
    if name in reached:
        return result
    owner = next(klass for klass in type(trainer).__mro__ if name in vars(klass))
    logger.error("%s.%s() did not call super().%s(): the trainer's mixins need it, so their "
                 "part ran after it; call super().%s() in the override", owner.__qualname__,
                 name, name, name)
    rest = getattr(super(owner, trainer), name)(*args)  # type: ignore[arg-type]
    if isinstance(result, dict) and isinstance(rest, dict):
        return {**rest, **result}
    return result


# -- configs a mixin needs ---------------------------------------------------------------------
def check_config_mixins(trainer: object, config: BaseModel) -> None:
    """Refuse a trainer whose mixins need config fields its config class does not have.

    A mixin names the config mixin it reads in a ``config_mixin`` class attribute; every field
    of that config mixin must be a field of ``config``.

    Raises:
        TypeError: naming the mixin and the config mixin to add to the config's bases.
    """
    fields = type(config).model_fields
    for klass in type(trainer).__mro__:
        needed = vars(klass).get("config_mixin")
        if needed is None:
            continue
        missing = [name for name in needed.model_fields if name not in fields]
        if missing:
            raise TypeError(
                f"{type(trainer).__name__} includes {klass.__name__}, which reads "
                f"config.{missing[0]}, but its config {type(config).__name__} has no such "
                f"field: add {needed.__name__} to the bases of {type(config).__name__} "
                f"(class {type(config).__name__}(..., {needed.__name__}))"
            )
