"""The optimizer step as declared stages, the points where capabilities join it, and the one
vote on whether its update happens.

``step()`` runs ``STAGES`` in order. Three of them are points that run what was registered
there (``StepPoints``), in registration order:

- ``after_backward``: the window's gradients, complete and at their true scale (unscaled,
  normalized by items), before they are measured and clipped; a pipeline sums the gradients
  of weights tied across stages here, and a user's mixin may add noise or its own reduction;
- ``vote``: every voter says whether the update happens (``UpdateVote``); each that says no
  is counted under its cause. Every voter runs every step: a vote may be a collective;
- ``after_update``: after the update (or its skip), before the gradients are zeroed;
  mixture-of-experts layers move their balancing bias here.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

logger = logging.getLogger(__name__)

StepAction = Callable[[nn.Module, torch.optim.Optimizer], None]
Voter = Callable[[nn.Module, torch.optim.Optimizer], bool]

# (stage, what it does); the documented order of ``step()`` (docs/concepts.md).
STAGES: tuple[tuple[str, str], ...] = (
    ("pre_optimizer_step", "hooks; fault tolerance averages across replica groups"),
    ("unscale", "float16: gradients back to their true scale"),
    ("normalize", "backward(loss, num_items=n): the mean over every item of the global batch"),
    ("after_backward", "point: tied pipeline weights summed; yours"),
    ("clip", "the total gradient norm, clipped to gradient_clip_val"),
    ("vote", "point: every voter says whether the update happens"),
    ("apply", "apply_update(): optimizer.step(), if the vote passed"),
    ("after_update", "point: MoE balancing bias; yours"),
    ("zero", "optimizer.zero_grad(set_to_none=True)"),
    ("schedule", "the optimizer's scheduler steps"),
    ("post_optimizer_step", "hooks"),
)


class StepPoints:
    """What runs at the step's ``after_backward`` and ``after_update`` points, by name."""

    def __init__(self) -> None:
        self.after_backward: dict[str, StepAction] = {}
        self.after_update: dict[str, StepAction] = {}

    def add(self, point: str, name: str, action: StepAction) -> None:
        """Run ``action(model, optimizer)`` at ``point`` of every ``step()`` from now on.

        Raises:
            ValueError: for an unknown point or a name already registered there.
        """
        actions = self._at(point)
        if name in actions:
            raise ValueError(f"a step action named {name!r} is already registered at "
                             f"{point}: give this one another name")
        actions[name] = action

    def run(self, point: str, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        actions: dict[str, StepAction] = getattr(self, point)  # step() names a known point
        for action in actions.values():
            action(model, optimizer)

    def _at(self, point: str) -> dict[str, StepAction]:
        if point not in ("after_backward", "after_update"):
            raise ValueError(f"no step point {point!r}: actions join 'after_backward' or "
                             "'after_update', voters the vote (UpdateVote.add)")
        actions: dict[str, StepAction] = getattr(self, point)
        return actions


class UpdateVote:
    """Whether an optimizer step's update happens: the one place a step is skipped.

    Voters (``add``) are asked at the vote stage of every step; a capability that decided
    earlier in the step casts a ``veto``. A step whose update does not happen is counted
    under each cause that said no (``skipped``), logged once, and kept in checkpoints.
    """

    def __init__(self) -> None:
        self.voters: dict[str, Voter] = {}
        self.skipped: dict[str, int] = {}
        self.vetoes: list[str] = []
        """The causes that vetoed the step under way (``veto``), until its vote."""

    def add(self, cause: str, voter: Voter) -> None:
        """Ask ``voter(model, optimizer)`` at every step; False skips the update.

        Raises:
            ValueError: for a cause that already has a voter.
        """
        if cause in self.voters:
            raise ValueError(f"the update vote already has a voter for {cause!r}")
        self.voters[cause] = voter

    def veto(self, cause: str) -> None:
        """Skip the update of the step under way, for ``cause``."""
        if cause not in self.vetoes:
            self.vetoes.append(cause)

    def decide(self, model: nn.Module, optimizer: torch.optim.Optimizer, step: int) -> bool:
        """Ask every voter (all of them: a vote may be a collective); True when the update of
        global step ``step`` (the one being taken) happens."""
        against, self.vetoes = self.vetoes, []
        for cause, voter in self.voters.items():
            if not voter(model, optimizer) and cause not in against:
                against.append(cause)
        for cause in against:
            self.skipped[cause] = self.skipped.get(cause, 0) + 1
        if against:
            counts = ", ".join(f"{cause} {self.skipped[cause]}" for cause in against)
            logger.warning("optimizer step %d: the update was skipped (%s); skipped so far: %s",
                           step, " and ".join(against), counts)
        return not against

    def state_dict(self) -> dict[str, Any]:
        return {"skipped": [[cause, count] for cause, count in sorted(self.skipped.items())]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.skipped = {str(cause): int(count) for cause, count in state.get("skipped", [])}
