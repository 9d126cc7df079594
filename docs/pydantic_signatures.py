"""A griffe extension that gives pydantic config models their constructor signature.

griffe reads the source without importing it, so a ``ConfigModel`` subclass has no
``__init__`` of its own and the API pages would show no signature. Pydantic's generated
``__init__`` takes every field as a keyword argument; this extension writes that signature
from the annotated fields of the class and of its bases, in pydantic's field order (a base's
fields first, an overriding field at its original position with its new default).
Loaded by ``mkdocs.yml`` (``plugins.mkdocstrings.handlers.python.options.extensions``).
"""

from __future__ import annotations

from typing import Any

import griffe

PYDANTIC_BASE = "pydantic.BaseModel"


class PydanticSignatures(griffe.Extension):
    """Add a keyword-only ``__init__`` listing the fields to every pydantic model."""

    def on_package(self, *, pkg: griffe.Module, **kwargs: Any) -> None:
        for cls in _classes(pkg):
            if "__init__" not in cls.members and _is_pydantic_model(cls):
                cls.set_member("__init__", _init_for(cls))


def _classes(module: griffe.Module | griffe.Class) -> list[griffe.Class]:
    found = []
    for member in module.members.values():
        if member.is_alias:
            continue
        if member.is_module or member.is_class:
            if member.is_class:
                found.append(member)
            found.extend(_classes(member))
    return found


def _is_pydantic_model(cls: griffe.Class) -> bool:
    for klass in (cls, *cls.mro()):
        for base in klass.bases:
            path = base if isinstance(base, str) else base.canonical_path
            if path == PYDANTIC_BASE:
                return True
    return False


def _fields(cls: griffe.Class) -> dict[str, griffe.Attribute]:
    """Annotated class attributes of ``cls`` and its bases, oldest definition first."""
    fields: dict[str, griffe.Attribute] = {}
    for klass in reversed((cls, *cls.mro())):
        for name, member in klass.members.items():
            if member.is_alias or not member.is_attribute or member.annotation is None:
                continue
            if name.startswith("_") or name == "model_config" \
                    or str(member.annotation).startswith("ClassVar"):
                continue
            fields[name] = member
    return fields


def _default(value: Any) -> str | griffe.Expr | None:
    """The default a field's value expression gives; None when the field is required."""
    if value is None:
        return None
    if isinstance(value, griffe.ExprCall) and str(value.function).endswith("Field"):
        for argument in value.arguments:
            if isinstance(argument, griffe.ExprKeyword):
                if argument.name == "default":
                    return argument.value
                if argument.name == "default_factory":
                    return f"{argument.value}()"
        return None
    return value


def _init_for(cls: griffe.Class) -> griffe.Function:
    parameters = [griffe.Parameter("self", kind=griffe.ParameterKind.positional_or_keyword)]
    for name, field in _fields(cls).items():
        parameters.append(griffe.Parameter(name, annotation=field.annotation,
                                           kind=griffe.ParameterKind.keyword_only,
                                           default=_default(field.value)))
    return griffe.Function("__init__", parent=cls, parameters=griffe.Parameters(*parameters),
                           returns="None")
