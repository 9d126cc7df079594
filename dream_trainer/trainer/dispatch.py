"""Running a lifecycle hook: the mixins' ``@runs_on`` work, the trainer's public hook, then
the callbacks' hooks (``BaseTrainer`` takes it from here)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from dream_trainer.trainer.abstract import AbstractTrainer
from dream_trainer.trainer.callback_collection import CallbackCollection
from dream_trainer.trainer.phases import phase_calls


class HookDispatch(AbstractTrainer):
    """``_fire`` and ``_fire_phase``. What runs at a hook is found once per hook and
    callback collection (several hooks fire every step), in ``_hook_calls``, which whoever
    replaces ``callbacks`` empties."""

    callbacks: CallbackCollection
    _hook_calls: dict[str, tuple[tuple[str, ...], list[Callable[..., None]]]]
    """Per hook: the trainer's methods to run and the callbacks' (live) listener list."""

    def _fire(self, hook: str, *args: Any) -> None:
        """Run the mixins' work at ``hook``, the trainer's own hook, then every callback's, in
        insertion order."""
        calls = self._hook_calls.get(hook)
        if calls is None:
            calls = self._hook_calls[hook] = (phase_calls(type(self), hook),
                                              self.callbacks.listeners(hook))
        names, listeners = calls
        for name in names:
            getattr(self, name)(*args)
        for listener in listeners:
            listener(*args)

    def _fire_phase(self, phase: str, *args: Any) -> None:
        """Run the mixins' ``@runs_on(phase)`` work, then the trainer's public method (the
        other way round for a closing phase such as ``post_fit``)."""
        for name in phase_calls(type(self), phase):
            getattr(self, name)(*args)
