"""``Callback`` and ``RankZeroCallback``: user code attached to the lifecycle hooks."""

from __future__ import annotations

import difflib
import typing
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from dream_trainer.trainer.hooks import HOOK_NAMES, HOOK_PREFIXES, TrainerHooks

if TYPE_CHECKING:
    from dream_trainer.trainer.abstract import AbstractTrainer

TrainerT = TypeVar("TrainerT", bound="AbstractTrainer")


class Callback(TrainerHooks, Generic[TrainerT]):
    """Override any lifecycle hook to run code at that point of ``fit()``.

    Parametrize with the trainer capabilities the callback needs: ``Callback[EvalMixin]``
    can only be attached to a trainer that is an ``EvalMixin``. Once attached, the trainer is
    ``self.trainer``; a capability used only when present (a logger) is decided in
    ``attached()``. Override ``state_dict``/``load_state_dict`` to keep state in checkpoints.
    """

    trainer: TrainerT
    rank_zero_only: typing.ClassVar[bool] = False

    def attached(self) -> None:
        """Run by ``CallbackCollection.attach`` once ``self.trainer`` is bound and its required
        capabilities are checked, on every rank: decide here, once, what depends on an
        optional capability (``isinstance(self.trainer, LoggerMixin)``), rather than in a hook
        each step. Does nothing by default; overrides need not call ``super()``.
        """

    def state_dict(self) -> dict[str, Any]:
        """State to store in checkpoints (empty by default)."""
        return {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore what ``state_dict`` returned."""

    def teardown(self) -> None:
        """Release what the callback holds (a thread, a profiler, a live display, a changed
        global setting), once, whichever way the run ends.

        Runs after ``post_fit`` or ``on_exception``, while the process group still exists,
        with the trainer's own teardown (also for a tool that called ``set_up()``), and even
        when another callback's teardown failed. It may run without any hook having run
        before it, and must not call collectives: another rank may already have failed.
        """

    @classmethod
    def trainer_requirements(cls) -> tuple[Any, ...]:
        """The trainer types named in ``Callback[...]`` anywhere in this class's bases."""
        required: list[Any] = []
        for klass in cls.__mro__:
            for base in getattr(klass, "__orig_bases__", ()):
                origin = typing.get_origin(base)
                if isinstance(origin, type) and issubclass(origin, Callback):
                    required.extend(arg for arg in typing.get_args(base)
                                    if not isinstance(arg, TypeVar))
        return tuple(dict.fromkeys(required))

    @classmethod
    def overridden_hooks(cls) -> tuple[str, ...]:
        """The hooks this class implements, in firing-declaration order."""
        return tuple(name for name in HOOK_NAMES
                     if getattr(cls, name) is not getattr(TrainerHooks, name))

    @classmethod
    def check_hook_names(cls) -> None:
        """Reject methods that look like hooks but are not (``pre_trian_batch``).

        Raises:
            AttributeError: naming the method and the closest real hook.
        """
        for name in dir(cls):
            if name.startswith(HOOK_PREFIXES) and name not in HOOK_NAMES \
                    and callable(getattr(cls, name)):
                close = difflib.get_close_matches(name, HOOK_NAMES, n=1)
                hint = f"did you mean {close[0]!r}?" if close else f"hooks are {HOOK_NAMES}"
                raise AttributeError(
                    f"{cls.__qualname__}.{name} looks like a lifecycle hook but is none, so it "
                    f"would never be called: {hint} (rename it, or drop the "
                    f"{'/'.join(HOOK_PREFIXES)} prefix for a helper)"
                )


class RankZeroCallback(Callback[TrainerT]):
    """A callback whose hooks run on global rank 0 only (printing, logging, files).

    Its hooks must not call collectives: the other ranks never reach them.
    """

    rank_zero_only = True
