"""The key map between torchtitan's MoE files and ``MoE`` layers made by
``replace_torchtitan_moe_blocks``: the router renamed, the stacked experts transposed."""

from __future__ import annotations

from typing import Literal

from dream_trainer.weights.keys import TransformedKey

_ROUTER = (".router.gate.weight", ".router.weight")  # (torchtitan's, MoE's)
_EXPERTS = (".experts.w1", ".experts.w2", ".experts.w3")


def torchtitan_moe_key(key: str, to: Literal["model", "file"] = "model"
                       ) -> str | TransformedKey | None:
    """The key of ``key`` on the other side, for a model whose MoE layers all came from
    torchtitan's: ``to="model"`` maps a key of torchtitan's files for
    ``map_pretrained_key``, ``to="file"`` a model key for ``map_exported_key``.

    ``<layer>.router.gate.weight`` and ``<layer>.router.weight`` map to each other; the
    stacked experts ``<layer>.experts.w1``/``w2``/``w3`` keep their keys and swap their last
    two dimensions (torchtitan's ``[E, hidden, dim]`` is ``MoE``'s ``[E, dim, hidden]``), as
    a ``TransformedKey(transpose=(1, 2))`` that each rank reads only its part of; torchtitan's
    ``tokens_per_expert`` counts are left out (``MoE`` keeps its own); every other key is
    unchanged.

    Raises:
        ValueError: for a ``to`` other than ``"model"`` or ``"file"``.
    """
    if to not in ("model", "file"):
        raise ValueError(f"torchtitan_moe_key: to={to!r} is not 'model' or 'file'")
    if key.endswith(_EXPERTS):
        return TransformedKey(key, transpose=(1, 2))
    if to == "model" and key.endswith(".tokens_per_expert"):
        return None
    source, target = _ROUTER if to == "model" else _ROUTER[::-1]
    return key.removesuffix(source) + target if key.endswith(source) else key
