"""The pydantic base every dream_trainer config derives from."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class ConfigModel(BaseModel):
    """A strict pydantic model: unknown fields are errors and assignments are validated.

    Configs compose by multiple inheritance (``class MyConfig(BaseTrainerConfig,
    SetupConfigMixin)``), so every config and config mixin shares this base.
    """

    model_config = ConfigDict(
        extra="forbid",
        validate_assignment=True,
        validate_default=True,
        arbitrary_types_allowed=True,
        use_attribute_docstrings=True,
    )
