"""What a key map may answer besides a new name: ``TransformedKey``, a tensor that changes form
between the files and the model (transposed, reshaped, any function with an inverse).

``SetupMixin.map_pretrained_key`` maps a file key to the model's key, and
``map_exported_key`` a model key to the exported file's; either may return a
``TransformedKey`` instead of a string. Loading applies ``to_model`` to the file's tensor,
exporting applies ``to_file`` to the model's, so one object describes both directions and
each map names the key on its own far side.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

Transform = Callable[[torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class TransformedKey:
    """A key map's answer for a tensor whose form differs between the files and the model.

    Give either ``transpose`` (two dimensions swapped, the same both ways: each rank then
    reads only the part of the file tensor that its shard holds) or both ``to_model`` and
    ``to_file`` (any function and its inverse: the file tensor is read whole on every rank,
    transformed, and each rank keeps its shard of the result).

    Args:
        key: The tensor's key on the other side of the map: the model's key in
            ``map_pretrained_key``, the file's key in ``map_exported_key``.
        transpose: The two dimensions to swap, e.g. ``(1, 2)`` (negative ones count from
            the end).
        to_model: File tensor -> model tensor, applied on load.
        to_file: Model tensor -> file tensor, applied on export.

    Raises:
        ValueError: for both kinds given, neither, one function without its inverse, or a
            ``transpose`` that is not two different dimensions.
    """

    key: str
    transpose: tuple[int, int] | None = None
    to_model: Transform | None = None
    to_file: Transform | None = None

    def __post_init__(self) -> None:
        functions = (self.to_model is not None, self.to_file is not None)
        if self.transpose is not None:
            if any(functions):
                raise ValueError(f"TransformedKey({self.key!r}): give transpose or to_model/"
                                 "to_file, not both")
            if len(self.transpose) != 2 or self.transpose[0] == self.transpose[1]:
                raise ValueError(f"TransformedKey({self.key!r}): transpose={self.transpose} "
                                 "must name two different dimensions, e.g. (1, 2)")
        elif not all(functions):
            raise ValueError(f"TransformedKey({self.key!r}): give transpose=(dim0, dim1), or "
                             "both to_model (applied on load) and to_file (its inverse, "
                             "applied on export)")

    def dims(self, ndim: int) -> tuple[int, int]:
        """The transposed dimensions of a tensor with ``ndim`` dimensions, non-negative.

        Raises:
            ValueError: if the tensor has no such dimension.
        """
        assert self.transpose is not None
        if not all(-ndim <= dim < ndim for dim in self.transpose):
            raise ValueError(f"TransformedKey({self.key!r}) transposes dimensions "
                             f"{self.transpose} of a tensor with {ndim}")
        first, second = (dim % ndim for dim in self.transpose)
        return first, second

    def model_tensor(self, tensor: torch.Tensor) -> torch.Tensor:
        """The model's tensor made from the file's ``tensor``."""
        if self.transpose is not None:
            return tensor.transpose(*self.dims(tensor.dim()))
        assert self.to_model is not None
        return self.to_model(tensor)

    def file_tensor(self, tensor: torch.Tensor) -> torch.Tensor:
        """The file's tensor made from the model's ``tensor``."""
        if self.transpose is not None:
            return tensor.transpose(*self.dims(tensor.dim()))
        assert self.to_file is not None
        return self.to_file(tensor)

    def model_shape(self, file_shape: tuple[int, ...]) -> tuple[int, ...]:
        """The shape ``model_tensor`` gives a file tensor of ``file_shape`` (computed on
        the meta device: nothing is allocated)."""
        return tuple(self.model_tensor(torch.empty(file_shape, device="meta")).shape)

    def file_shape(self, model_shape: tuple[int, ...]) -> tuple[int, ...]:
        """The shape ``file_tensor`` gives a model tensor of ``model_shape``."""
        return tuple(self.file_tensor(torch.empty(model_shape, device="meta")).shape)


MappedKey = str | TransformedKey | None
"""What a key map returns: a key, a ``TransformedKey``, or None to skip the key."""

KeyMap = Callable[[str, str], MappedKey]
"""``(model name, key) -> key``, a ``TransformedKey``, or None to skip the key."""


def mapped_name(mapped: str | TransformedKey | None) -> str | None:
    """The key a key map's answer names (None: the key is skipped)."""
    return mapped.key if isinstance(mapped, TransformedKey) else mapped


def exported_names(model: str, keys: Iterable[str],
                   map_key: KeyMap | None) -> dict[str, tuple[str, TransformedKey | None]]:
    """``{exported key: (the model's key, its transform or None)}``: each key through
    ``map_key`` (None drops it).

    Raises:
        ValueError: if two keys map to the same exported key.
    """
    renamed: dict[str, tuple[str, TransformedKey | None]] = {}
    for key in keys:
        mapped = map_key(model, key) if map_key is not None else key
        target = mapped_name(mapped)
        if target is None:
            continue
        if target in renamed:
            raise ValueError(f"map_exported_key({model!r}, ...) maps both "
                             f"{renamed[target][0]!r} and {key!r} to {target!r}: each exported "
                             "key must be unique")
        renamed[target] = (key, mapped if isinstance(mapped, TransformedKey) else None)
    return renamed
