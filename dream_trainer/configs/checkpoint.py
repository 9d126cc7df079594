"""When and where checkpoints are written, which are kept, and what a run resumes from."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Literal

from pydantic import Field, NonNegativeFloat, PositiveInt, field_validator, model_validator

from dream_trainer.configs.base import ConfigModel

_GLOBAL_NAME = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)+$")


def url_or_path(value: object) -> object:
    """A URL (``s3://bucket/prefix``) stays a string, which ``Path`` would corrupt (it folds
    ``//``); any other string is a local path; a mapping's values and a list's items are
    converted alike."""
    if isinstance(value, dict):
        return {key: url_or_path(item) for key, item in value.items()}
    if isinstance(value, list):
        return [url_or_path(item) for item in value]
    if isinstance(value, str) and "://" not in value and value != "latest":
        return Path(value)
    return value


class CheckpointParameters(ConfigModel):
    """Checkpoint cadence, retention and resumption.

    A checkpoint is also written when training ends. Checkpoints live in
    ``<root_dir>/<project>/<group>/<experiment>/checkpoints/step_<N>/``, on a local
    filesystem or, for a ``root_dir`` such as ``s3://bucket/prefix``, in an object store
    (credentials and endpoint from the environment: see docs/checkpointing.md).
    """

    enabled: bool = True
    """Write checkpoints at all. ``False`` writes nothing (no periodic, final or preemption
    checkpoint, no lock) and cannot resume."""
    # Left to right: a URL string stays one (JSON would otherwise pick Path, folding "//").
    root_dir: str | Path = Field(Path("outputs"), union_mode="left_to_right")
    """Directory under which every run's checkpoints are written: a local path, or an
    object-store URL (``s3://bucket/prefix``, any fsspec URL; the ``s3`` extra)."""
    every_n_steps: PositiveInt | None = None
    """Save after every N optimizer steps (``None``: not by steps)."""
    every_n_epochs: PositiveInt | None = 1
    """Save after every N epochs, validation included (``None``: not by epochs)."""
    keep_top_k: PositiveInt | None = None
    """Keep this many checkpoints: the best by ``monitor``, else the newest. The newest is
    always kept, so that a run can resume. ``None`` keeps every checkpoint."""
    monitor: str | None = None
    """Result key that ranks checkpoints for ``keep_top_k`` (``"val_loss"``, or any key of the
    last training or validation epoch result)."""
    mode: Literal["min", "max"] = "min"
    """Whether a smaller or larger ``monitor`` value is better."""
    resume: Literal["latest"] | str | Path | None = Field(None, union_mode="left_to_right")
    """``"latest"``: continue from the newest complete checkpoint of this experiment, or start
    fresh if there is none; a path or URL: resume from that checkpoint; ``None``: start
    fresh."""
    load_weights_only: bool = False
    """With ``resume`` set to a path, load only the model weights (fine-tuning from another
    run): optimizers, schedulers, counters and data position start fresh."""
    save_frozen_weights: bool = False
    """Keep frozen weights that ``init_weights_from`` set (a LoRA base, a reference model) in
    every checkpoint. ``False`` leaves them out: the checkpoint records their source and a
    checksum of its files (``models.json``), and a resume reads them from there again,
    refusing a source whose files changed."""
    async_save: bool = False
    """Write periodic checkpoints in the background (the final one is always synchronous)."""
    preemption_poll_seconds: NonNegativeFloat = 1.0
    """With several ranks, about how much training time passes between the ranks' votes on a
    preemption signal (each an all-reduce on a CPU group of their own): a signal is acted on
    within about twice this, at a step boundary all ranks share. ``0``: every step, acting
    on a signal one step after it (a quarter of the step time of 2 CPU ranks of a small
    model). At most 100 steps pass between votes."""
    trusted_globals: list[str] = Field(default_factory=list)
    """Types (``"package.module.ClassName"``) that checkpoints this run reads may unpickle
    besides the allowlist (tensors, builtin containers and scalars, DCP's metadata): your own
    class kept in ``extra_state_dict`` or a callback's state. Reading never runs code of any
    other type."""

    @field_validator("root_dir", "resume")
    @classmethod
    def _keep_urls(cls, value: object) -> object:
        return url_or_path(value)

    @field_validator("trusted_globals")
    @classmethod
    def _check_global_names(cls, names: list[str]) -> list[str]:
        for name in names:
            if not _GLOBAL_NAME.match(name):
                raise ValueError(f"{name!r} is not a global's full name: write it as "
                                 "'package.module.ClassName'")
        return names

    @model_validator(mode="after")
    def _check(self) -> CheckpointParameters:
        if not self.enabled and self.resume is not None:
            raise ValueError(
                f"resume={str(self.resume)!r} needs checkpoints, but enabled=False turns them "
                "off: set resume=None, or enabled=True"
            )
        if self.load_weights_only and self.resume in (None, "latest"):
            raise ValueError(
                "load_weights_only=True needs resume=<path to a checkpoint> to take the "
                "weights from"
            )
        if self.keep_top_k is not None and self.every_n_steps is None \
                and self.every_n_epochs is None:
            raise ValueError("keep_top_k is set but no cadence is: set every_n_steps or "
                             "every_n_epochs")
        return self
