"""``NanGuard``: stop training, or skip the update, when it produces NaN or infinity."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Literal, NamedTuple, get_args

import torch
from torch import nn
from typing_extensions import override

from dream_trainer.callbacks.nan_provenance import (MicroBatch, NanFinding, NanReport,
                                                    diagnose_window)
from dream_trainer.parallel.dtensor import local_tensor
from dream_trainer.trainer.callback import Callback
from dream_trainer.world.agree import agree_any, agree_max, gather_objects

logger = logging.getLogger(__name__)
# The cause a skipped update is counted under in the trainer's update vote.
VOTE_CAUSE = "nan_guard"

NanGuardMode = Literal["raise", "skip"]
GRAD_NORM = "grad_norm"
"""The result key of the value ``step()`` returns, checked whenever a step returns it."""


class _Value(NamedTuple):
    """One result value waiting for the next check, and where it came from."""

    step: int
    batch_idx: int
    epoch: int
    key: str
    value: torch.Tensor


# Verdicts of one check, ordered so that the maximum over ranks is the one every rank acts on.
_FINITE, _IN_WINDOW, _EARLIER = 0, 1, 2


class NanGuard(Callback):
    """Catch non-finite training values: raise where they first appeared, or skip the update;
    with ``diagnose``, first find the module that produced them.

    ``"raise"`` keeps the ``keys`` (and ``"grad_norm"``) of every training result as device
    tensors and checks them together every ``check_every_n_steps`` optimizer steps and at each
    epoch's end: one host sync per check, none per step. ``"skip"`` checks the gradients in
    ``pre_optimizer_step``, at the cost of one host sync and one all-reduce per optimizer step,
    and drops the gradients of a step that has a non-finite one on any rank.

    With ``diagnose`` (single device or DDP), raise mode checks in ``pre_optimizer_step``
    instead, before the update: the gradients and the values kept since the last check, with
    one host sync and one all-reduce per check. When they are not finite, every rank re-runs
    the window's micro-batches from the state before the update with hooks on every module
    (``rerun_training_step``), the first module whose output or input gradient became
    non-finite is named, the offending micro-batch is saved, and all of it goes into
    ``report`` and the error.

    Args:
        mode: ``"raise"`` or ``"skip"``.
        check_every_n_steps: In raise mode, optimizer steps between checks (skip mode checks
            every step and requires 1).
        keys: In raise mode, the training-result keys to check; each must be in every result.
        diagnose: Re-run a non-finite step to find where its values came from.
        output_dir: Where diagnosed micro-batches are saved, under the run's
            ``<project>/<group>/<experiment>``.

    Attributes:
        skipped_steps: In skip mode, optimizer steps skipped so far (the trainer's
            ``update_vote`` count under ``"nan_guard"``, kept in checkpoints).
        report: The latest diagnosis (``NanReport``), None before the first.

    Raises:
        ValueError: if an argument is invalid.
    """

    def __init__(self, mode: NanGuardMode = "raise", check_every_n_steps: int = 1,
                 keys: tuple[str, ...] = ("loss",), diagnose: bool = True,
                 output_dir: str | Path = "nan_guard") -> None:
        if mode not in get_args(NanGuardMode):
            raise ValueError(f"NanGuard(mode={mode!r}): mode must be 'raise' (stop at the first "
                             "non-finite value) or 'skip' (skip steps with non-finite gradients)")
        if isinstance(check_every_n_steps, bool) or not isinstance(check_every_n_steps, int) \
                or check_every_n_steps < 1:
            raise ValueError(f"NanGuard(check_every_n_steps={check_every_n_steps!r}): must be an "
                             "int >= 1")
        if mode == "skip" and check_every_n_steps != 1:
            raise ValueError(f"NanGuard(mode='skip', check_every_n_steps={check_every_n_steps}): "
                             "skip mode must check every step to keep non-finite gradients out "
                             "of the weights; leave check_every_n_steps at 1")
        if not isinstance(keys, tuple) or not all(isinstance(k, str) and k for k in keys):
            raise ValueError(f"NanGuard(keys={keys!r}): keys must be a tuple of result keys, "
                             "such as ('loss',)")
        if not isinstance(diagnose, bool):
            raise ValueError(f"NanGuard(diagnose={diagnose!r}): must be True or False")
        self.mode: NanGuardMode = mode
        self.check_every_n_steps = check_every_n_steps
        self.keys = keys
        self.diagnose = diagnose
        self.output_dir = Path(output_dir)
        self.report: NanReport | None = None
        self._pending: list[_Value] = []
        self._step = 0
        self._batch_idx = 0
        self._check_grad_norm = True
        self._diagnosing = False
        self._window: list[MicroBatch] = []
        self._checked_in_window = False

    # -- hooks -----------------------------------------------------------------------------
    @override
    def pre_launch(self) -> None:
        # float16's GradScaler skips steps whose gradients overflowed and lowers its scale:
        # there an infinite gradient norm is routine, and dropping the gradients first would
        # hide the overflow from the scaler, so its scale would never come down.
        float16 = self.trainer.config.device_parameters.param_dtype == torch.float16
        if float16 and self.mode == "skip":
            raise ValueError(
                "NanGuard(mode='skip') cannot run with param_dtype=float16: the gradient "
                "scaler already skips steps with non-finite gradients; use mode='raise' (which "
                "then checks the loss only) or bfloat16"
            )
        self._check_grad_norm = not float16

    @override
    def post_setup(self) -> None:
        reason = self._why_not_diagnosed()
        self._diagnosing = self.diagnose and reason is None
        if self.diagnose and reason is not None and self.trainer.world.is_rank_zero:
            logger.info("NanGuard: no diagnosis in this run: %s", reason)

    @override
    def pre_train_batch(self, batch: Any, batch_idx: int) -> None:
        # Steps are named as training_step sees them: the loop counts a step only after it.
        self._step, self._batch_idx = self.trainer.global_step, batch_idx
        if not self._diagnosing:
            return
        if batch_idx % self.trainer.training_parameters.gradient_accumulation_steps == 0:
            self._window.clear()  # an epoch may have ended inside the last window
        self._window.append(MicroBatch.capture(batch, batch_idx, self.trainer.world.device))

    @override
    def post_train_batch(self, result: dict[str, Any], batch_idx: int) -> None:
        trainer = self.trainer
        window_done = not trainer.is_accumulating_gradients
        if self.mode == "raise":
            for key in self._keys_in(result):
                self._pending.append(_Value(self._step, batch_idx, trainer.current_epoch, key,
                                            self._as_scalar(key, result[key])))
            # Without diagnosis, or when training_step never called step(), the check is here.
            if window_done and not self._checked_in_window \
                    and trainer.global_step % self.check_every_n_steps == 0:
                self._check()
        if window_done:
            self._window.clear()
            self._checked_in_window = False

    @override
    def pre_optimizer_step(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        if self.mode == "raise":
            if self._diagnosing \
                    and (self.trainer.global_step + 1) % self.check_every_n_steps == 0:
                self._checked_in_window = True
                self._check_before_update(model)
            return
        # Every rank must skip or step together: FSDP2 and tensor-parallel ranks each hold
        # only part of the gradients.
        if not agree_any(not bool(self._grads_finite(model)), self.trainer.world.device):
            return
        if self._diagnosing:
            self.report = self._diagnose()
        # The trainer's one vote skips the update and counts it under "nan_guard".
        self.trainer.update_vote.veto(VOTE_CAUSE)
        if self.trainer.world.is_rank_zero:
            logger.warning("NanGuard: non-finite gradients at global step %d (batch %d of epoch "
                           "%d): skipped this optimizer step (%d skipped so far)%s", self._step,
                           self._batch_idx, self.trainer.current_epoch, self.skipped_steps + 1,
                           f"\n{self.report}" if self._diagnosing else "")

    @override
    def post_train_epoch(self, result: dict[str, Any]) -> None:
        if self.mode == "raise":
            self._check()

    @override
    def on_exception(self, exception: BaseException) -> None:
        self._pending.clear()
        self._window.clear()

    # -- state -----------------------------------------------------------------------------
    @property
    def skipped_steps(self) -> int:
        """In skip mode, optimizer steps skipped so far: the trainer's ``update_vote`` count
        under ``"nan_guard"``, which checkpoints keep with the loop's state."""
        trainer = getattr(self, "trainer", None)
        return 0 if trainer is None else trainer.update_vote.skipped.get(VOTE_CAUSE, 0)

    # -- diagnosis -------------------------------------------------------------------------
    def _why_not_diagnosed(self) -> str | None:
        """Why this run cannot re-run a micro-batch on each rank alone, or None if it can."""
        dims = self.trainer.world.dims
        if not self._check_grad_norm:
            return ("with param_dtype=float16 overflowing gradients are routine (the scaler "
                    "skips those steps), so only the loss is checked, after the update")
        # Every degree but dp_replicate (DDP can pass a rank alone) makes passes collective.
        collective = [f"{name}={degree}" for name, degree in dims.degrees().items()
                      if degree > 1 and name != "dp_replicate"]
        if collective:
            return (f"with {', '.join(collective)} every forward and backward is collective, "
                    "and each rank's re-run stops at its own first finding, so the ranks would "
                    "wait on each other: non-finite values are still caught, and named by step "
                    "and batch")
        return None

    def _check_before_update(self, model: nn.Module) -> None:
        """Raise mode's check with diagnosis: the gradients about to be applied and every
        value kept since the last check, agreed across ranks (one all-reduce, one host
        sync); diagnose and raise if any is not finite.

        Raises:
            FloatingPointError: with the report as its message.
        """
        pending, self._pending = self._pending, []
        in_window = [entry.value for entry in pending if entry.step == self._step]
        earlier = [entry.value for entry in pending if entry.step != self._step]
        bad_in_window = ~self._grads_finite(model)
        if in_window:
            bad_in_window = bad_in_window | ~torch.isfinite(torch.stack(in_window)).all()
        bad_earlier = ~torch.isfinite(torch.stack(earlier)).all() if earlier \
            else torch.zeros_like(bad_in_window)
        verdict = agree_max(torch.where(bad_earlier, _EARLIER,
                                        torch.where(bad_in_window, _IN_WINDOW, _FINITE)),
                            self.trainer.world.device)
        if verdict == _FINITE:
            return
        if verdict == _EARLIER:
            # The window that produced the value is gone: name it, re-run nothing (a re-run
            # of this window, with weights the bad step already changed, would mislead).
            self.report = self._gathered(self._earlier_finding(pending))
        else:
            self.report = self._diagnose()
        raise FloatingPointError(str(self.report))

    def _diagnose(self) -> NanReport:
        """Re-run this rank's window (every rank does: under DDP the all-reduce has mixed
        every rank's gradients, so no rank can tell from them whether the value was its
        own) and gather every rank's finding."""
        trainer = self.trainer
        batch_path = trainer.config.run_dir(self.output_dir) \
            / f"step_{self._step}_rank{trainer.world.rank}.pt"
        finding = diagnose_window(trainer, self._window, self.keys, self._step, batch_path)
        return self._gathered(finding)

    def _earlier_finding(self, pending: list[_Value]) -> NanFinding:
        """This rank's first non-finite kept value, from a step before the current one."""
        trainer = self.trainer
        flags = torch.isfinite(torch.stack([entry.value for entry in pending])).tolist() \
            if pending else []
        if all(flags):
            return NanFinding(trainer.world.rank, "finite", self._step, trainer.current_epoch,
                              None, detail="every value it kept was finite")
        first = pending[flags.index(False)]
        return NanFinding(trainer.world.rank, "value", first.step, first.epoch,
                          first.batch_idx, detail=(
                              f"{self._values_of(first, pending, flags)} at global step "
                              f"{first.step}, checked at step {self._step}: that window is "
                              "gone, so nothing was re-run (check_every_n_steps=1 re-runs it)"))

    def _gathered(self, finding: NanFinding) -> NanReport:
        """Every rank's finding, in rank order (a collective: every rank calls it)."""
        findings = tuple(f for f in gather_objects(finding) if f is not None)
        return NanReport(self._step, self.trainer.current_epoch, findings)

    # -- helpers ---------------------------------------------------------------------------
    def _grads_finite(self, model: nn.Module) -> torch.Tensor:
        """Whether the gradients of ``model`` (this rank's shard) have a finite norm, on the
        device: one fused read of every gradient (a norm past float32's range, from
        gradients of about 1e19, counts as non-finite, as ``grad_norm`` would)."""
        grads = [local_tensor(p.grad) for p in model.parameters() if p.grad is not None]
        if not grads:
            return torch.ones((), dtype=torch.bool, device=self.trainer.world.device)
        return torch.isfinite(torch.nn.utils.get_total_norm(grads, foreach=True))

    def _keys_in(self, result: dict[str, Any]) -> list[str]:
        """The keys of ``result`` to check.

        Raises:
            KeyError: if a configured key is missing from ``result``.
        """
        missing = [key for key in self.keys if key not in result]
        if missing:
            raise KeyError(f"NanGuard checks {missing} but training_step returned only "
                           f"{sorted(result)}: pass keys=(...) naming values it returns")
        keys = list(self.keys)
        if self._check_grad_norm and GRAD_NORM in result and GRAD_NORM not in keys:
            keys.append(GRAD_NORM)
        return keys

    def _as_scalar(self, key: str, value: Any) -> torch.Tensor:
        """``value`` as a float32 scalar on the device that is non-finite exactly when it is.

        Raises:
            TypeError: if ``value`` is neither a tensor nor a real number.
        """
        device = self.trainer.world.device
        if isinstance(value, torch.Tensor):
            scalar = value.detach()
            if scalar.numel() != 1:
                # amax propagates NaN, and an element is infinite exactly when the largest
                # magnitude is.
                scalar = scalar.abs().amax() if scalar.numel() else scalar.new_zeros(())
            return scalar.reshape(()).to(device=device, dtype=torch.float32)
        if isinstance(value, (int, float)):
            return torch.full((), float(value), device=device)
        raise TypeError(f"NanGuard checks {key!r}, but training_step returned a "
                        f"{type(value).__name__} for it: return a tensor or a number")

    def _check(self) -> None:
        """Raise if a pending value is non-finite, naming the first one (one host sync).

        Raises:
            FloatingPointError: naming the global step, batch and values where it appeared.
        """
        if not self._pending:
            return
        pending, self._pending = self._pending, []
        finite = torch.isfinite(torch.stack([entry.value for entry in pending]))
        if bool(finite.all()):
            return
        flags = finite.tolist()
        first = pending[flags.index(False)]
        raise FloatingPointError(
            f"non-finite training value at global step {first.step} (batch {first.batch_idx} "
            f"of epoch {first.epoch}): {self._values_of(first, pending, flags)}. Look for a "
            "too-high learning rate, a log or division of zero, or bad data in that batch; "
            "NanGuard(mode='skip') skips such steps instead"
        )

    @staticmethod
    def _values_of(first: _Value, pending: list[_Value], flags: list[bool]) -> str:
        """``"loss=nan, grad_norm=nan"``: the non-finite values of ``first``'s batch."""
        return ", ".join(f"{entry.key}={entry.value.item()}"
                         for entry, ok in zip(pending, flags)
                         if not ok and entry.step == first.step
                         and entry.batch_idx == first.batch_idx)
