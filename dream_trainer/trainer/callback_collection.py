"""``CallbackCollection``: an ordered set of callbacks and the hook dispatch over them."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any

from pydantic import GetCoreSchemaHandler, GetJsonSchemaHandler
from pydantic.json_schema import JsonSchemaValue
from pydantic_core import core_schema

from dream_trainer.trainer.callback import Callback
from dream_trainer.trainer.hooks import HOOK_NAMES, TrainerHooks

if TYPE_CHECKING:
    from dream_trainer.trainer.abstract import AbstractTrainer

logger = logging.getLogger(__name__)


class CallbackCollection(TrainerHooks):
    """Callbacks in insertion order, dispatched hook by hook.

    Calling a hook on the collection (``collection.post_train_batch(result, i)``) calls it on
    each attached callback that overrides it, in insertion order; callbacks that do not
    override a hook cost nothing for it. ``attach()`` checks every callback before any runs.

    Args:
        callbacks: The callbacks, in the order their hooks run.
    """

    def __init__(self, callbacks: Iterable[Callback[Any]] = ()) -> None:
        self._callbacks: list[Callback[Any]] = []
        self._active: list[Callback[Any]] = []  # attached and running on this rank
        self._listeners: dict[str, list[Callable[..., None]]] = {name: [] for name in HOOK_NAMES}
        for callback in callbacks:
            self.append(callback)

    def append(self, callback: Callback[Any]) -> None:
        """Add a callback at the end. Attach (or re-attach) before ``fit()`` to activate it.

        Raises:
            TypeError: if ``callback`` is not a ``Callback`` instance.
        """
        if not isinstance(callback, Callback):
            raise TypeError(
                f"{callback!r} is not a Callback instance: subclass "
                "dream_trainer.callbacks.Callback and pass an instance"
            )
        callback.check_hook_names()
        self._callbacks.append(callback)

    def __iter__(self) -> Iterator[Callback[Any]]:
        return iter(self._callbacks)

    def __len__(self) -> int:
        return len(self._callbacks)

    def __getitem__(self, index: int) -> Callback[Any]:
        return self._callbacks[index]

    def __repr__(self) -> str:
        return f"CallbackCollection({self._callbacks!r})"

    def attach(self, trainer: AbstractTrainer) -> None:
        """Bind every callback to ``trainer`` and build the dispatch table.

        Every callback's requirements are checked before any is bound; then each is bound and
        its ``attached()`` runs, in order. Rank-zero callbacks get no hooks on the other ranks.

        Raises:
            TypeError: if a callback requires a trainer capability (``Callback[EvalMixin]``)
                that ``trainer`` does not have, naming both and where the capability lives.
        """
        for callback in self._callbacks:
            missing = [req for req in callback.trainer_requirements()
                       if not isinstance(trainer, req)]
            if missing:
                names = ", ".join(getattr(req, "__name__", repr(req)) for req in missing)
                sources = ", ".join(_qualified(req) for req in missing)
                owner = type(trainer).__qualname__
                raise TypeError(
                    f"{type(callback).__qualname__} requires a trainer that is a {names}, but "
                    f"{owner} is not: add {sources} to the bases of {owner}, or remove the "
                    "callback"
                )
        for listeners in self._listeners.values():
            listeners.clear()
        self._active.clear()
        for callback in self._callbacks:
            callback.trainer = trainer
            callback.attached()
            if callback.rank_zero_only and not trainer.world.is_rank_zero:
                continue
            self._active.append(callback)
            for name in callback.overridden_hooks():
                self._listeners[name].append(getattr(callback, name))

    def listeners(self, hook: str) -> list[Callable[..., None]]:
        """The bound hook methods that run for ``hook``, in order: the same list for the
        collection's whole life, which ``attach()`` refills, so a caller may keep it.

        Raises:
            KeyError: if ``hook`` is not a declared hook name.
        """
        return self._listeners[hook]

    def teardown(self) -> None:
        """Run every attached callback's ``teardown()``, each even if another raises; then
        raise the first error."""
        first_error: BaseException | None = None
        for callback in self._active:
            try:
                callback.teardown()
            except BaseException as exc:  # noqa: BLE001 - re-raised below, after the others ran
                first_error = first_error or exc
                logger.error("%s.teardown() failed: %s: %s", type(callback).__qualname__,
                             type(exc).__name__, exc)
        if first_error is not None:
            raise first_error

    def _keys(self) -> list[str]:
        seen: dict[str, int] = {}
        keys = []
        for callback in self._callbacks:
            name = type(callback).__qualname__
            keys.append(name if name not in seen else f"{name}#{seen[name]}")
            seen[name] = seen.get(name, 0) + 1
        return keys

    def state_dict(self) -> dict[str, dict[str, Any]]:
        """Each callback's state, keyed by class name (``Name#1`` for a second instance)."""
        return {key: cb.state_dict() for key, cb in zip(self._keys(), self._callbacks)}

    def load_state_dict(self, state_dict: dict[str, dict[str, Any]]) -> None:
        """Restore the callbacks' states; keys without a matching callback are reported."""
        keys = self._keys()
        for key, callback in zip(keys, self._callbacks):
            if key in state_dict:
                callback.load_state_dict(state_dict[key])
        unused = sorted(set(state_dict) - set(keys))
        if unused:
            logger.warning("checkpoint has state for callbacks that are not attached: %s", unused)

    @classmethod
    def __get_pydantic_core_schema__(
        cls, source: Any, handler: GetCoreSchemaHandler
    ) -> core_schema.CoreSchema:
        return core_schema.no_info_plain_validator_function(
            cls._coerce,
            serialization=core_schema.plain_serializer_function_ser_schema(
                lambda collection: [type(cb).__qualname__ for cb in collection]
            ),
        )

    @classmethod
    def __get_pydantic_json_schema__(
        cls, schema: core_schema.CoreSchema, handler: GetJsonSchemaHandler
    ) -> JsonSchemaValue:
        return {"type": "array", "items": {"type": "string"},
                "description": "callback class names, in dispatch order"}

    @classmethod
    def _coerce(cls, value: Any) -> CallbackCollection:
        if isinstance(value, CallbackCollection):
            return value
        if isinstance(value, (list, tuple)):
            try:
                return cls(value)
            except (TypeError, AttributeError) as exc:
                raise ValueError(str(exc)) from exc  # pydantic reports ValueErrors by field
        raise ValueError(
            f"expected a CallbackCollection or a list of Callback instances, got "
            f"{type(value).__name__}"
        )


def _qualified(requirement: Any) -> str:
    """``LoggerMixin (from dream_trainer.mixins.logging)``: where to import it from."""
    name = getattr(requirement, "__name__", repr(requirement))
    module = getattr(requirement, "__module__", None)
    return f"{name} (from {module})" if module else name


def _make_dispatcher(name: str) -> Callable[..., None]:
    def dispatch(self: CallbackCollection, *args: Any) -> None:
        for listener in self._listeners[name]:
            listener(*args)

    dispatch.__name__ = dispatch.__qualname__ = name
    dispatch.__doc__ = getattr(TrainerHooks, name).__doc__
    return dispatch


for _name in HOOK_NAMES:
    setattr(CallbackCollection, _name, _make_dispatcher(_name))
del _name
