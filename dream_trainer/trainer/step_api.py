"""The step API: ``backward``, ``forward_backward``/``forward_loss`` and ``step``, the calls a
``training_step`` makes, the same with or without a pipeline."""

from __future__ import annotations

import contextlib
from abc import abstractmethod
from typing import Any

import torch
from torch import nn
from torch.optim.lr_scheduler import LRScheduler

from dream_trainer.parallel.expert_balance import ExpertBalancing
from dream_trainer.parallel.pipeline_schedule import LossFn
from dream_trainer.parallel.precision import Precision
from dream_trainer.trainer.abstract import AbstractTrainer
from dream_trainer.trainer.item_weighting import ItemWeighting
from dream_trainer.trainer.phases import runs_on
from dream_trainer.trainer.schedulers import takes_metric
from dream_trainer.trainer.step_stages import StepPoints, UpdateVote
from dream_trainer.trainer.validation import check_result


class StepAPI(AbstractTrainer):
    """The step half of ``BaseTrainer``: what ``training_step`` calls to turn a loss into an
    optimizer step (gradient accumulation, token weighting, mixed precision, clipping, the
    scheduler), whatever the parallel layout."""

    precision: Precision
    item_weighting: ItemWeighting
    _batch_idx: int
    step_points: StepPoints
    """What runs at the step's ``after_backward`` and ``after_update`` points."""
    update_vote: UpdateVote
    """Whether each step's update happens, and the skipped updates per cause."""
    _rerunning = False
    """True inside ``rerun_training_step``: ``backward()`` counts nothing, ``step()`` is inert."""
    _accumulation: int
    """``gradient_accumulation_steps``, read from the config once (``BaseTrainer``)."""
    _schedulers_by_optimizer: dict[torch.optim.Optimizer, LRScheduler | None]
    """The scheduler each optimizer steps with, found once: the lookup reads every
    scheduler attribute, which each step would pay for."""

    @abstractmethod
    def _fire(self, hook: str, *args: Any) -> None:
        """Run a hook on the trainer and every callback (``BaseTrainer``)."""

    def backward(self, loss: torch.Tensor, num_items: int | torch.Tensor | None = None) -> None:
        """Backpropagate ``loss`` so that the optimizer step sees the right average.

        Without ``num_items``, ``loss`` is a mean over the micro-batch and is scaled by
        ``1 / gradient_accumulation_steps``: the update is the mean over micro-batches and
        ranks. With ``num_items=n``, ``loss`` is a *sum* over ``n`` items (valid tokens,
        say): ``step()`` then scales the gradients so that the update is the mean over every
        item of the global batch, however the items fall across micro-batches and ranks (see
        ``ItemWeighting``). With float16 the loss is also multiplied by the gradient scaler's
        scale. Gradient synchronisation is already disabled on accumulating micro-batches.

        Args:
            loss: A 0-dim loss tensor.
            num_items: How many items ``loss`` sums over (an int or a 0-dim tensor; a tensor
                is never read on the host).

        Raises:
            RuntimeError: if called outside a training step.
            ValueError: if one accumulation window mixes calls with and without
                ``num_items``.
        """
        if not self.training:
            raise RuntimeError("backward() may only be called inside training_step")
        self.layout.check_backward()
        divisor = self._count_items(num_items)
        if divisor > 1:
            loss = loss / divisor
        scaler = self.precision.scaler
        (loss if scaler is None else scaler.scale(loss)).backward()

    def forward_backward(self, model: nn.Module, *inputs: Any, target: Any, loss_fn: LossFn,
                         num_items: int | torch.Tensor | None = None) -> torch.Tensor:
        """Compute ``loss_fn(model(*inputs), target)`` and backpropagate it, with or without a
        pipeline.

        Without a pipeline this is ``loss = loss_fn(model(*inputs), target)`` then
        ``backward(loss, num_items)``. Under ``pipeline_parallel > 1`` it runs the schedule:
        the inputs feed the first stage and the target the last, each is split into
        ``pipeline_microbatches`` along dim 0, and ``loss_fn`` runs per microbatch on the last
        stage; the gradients are those of the whole micro-batch, accumulated as
        ``backward()`` would. With ``loss_parallel`` the loss runs inside torch's
        ``loss_parallel()``.

        Args:
            model: The model (under a pipeline, its ``PipelineStages``).
            *inputs: The model's positional inputs.
            target: The second argument of ``loss_fn``.
            loss_fn: ``loss_fn(output, target) -> loss``: a mean over the batch, or a sum over
                ``num_items`` items when ``num_items`` is given.
            num_items: As for ``backward()``.

        Returns:
            The loss, detached: ``loss_fn``'s value on the whole micro-batch (under a
            pipeline the mean of the microbatch losses, or their sum with ``num_items``), the
            same on every rank, without a host sync.

        Raises:
            RuntimeError: if called outside a training step.
            ValueError: if the batch does not split into the pipeline's microbatches.
        """
        if not self.training:
            raise RuntimeError("forward_backward() may only be called inside training_step")
        with self._loss_context():
            return self.layout.forward_backward(
                model, inputs, target, loss_fn,
                backward=lambda loss: self.backward(loss, num_items=num_items),
                loss_scale=lambda: 1.0 / self._count_items(num_items),
                sum_losses=num_items is not None)

    def forward_loss(self, model: nn.Module, *inputs: Any, target: Any, loss_fn: LossFn,
                     num_items: int | torch.Tensor | None = None) -> torch.Tensor:
        """``forward_backward`` without the backward and without gradients, for
        ``validation_step``: the same loss on every rank, under a pipeline or not.

        Args:
            model, inputs, target, loss_fn: As for ``forward_backward``.
            num_items: Given when ``loss_fn`` returns a sum (the microbatch losses are then
                added up, as in ``forward_backward``); not otherwise used.

        Raises:
            ValueError: if the batch does not split into the pipeline's microbatches.
        """
        with torch.no_grad(), self._loss_context():
            return self.layout.forward_loss(model, inputs, target, loss_fn,
                                            sum_losses=num_items is not None)

    def _count_items(self, num_items: int | torch.Tensor | None) -> int:
        """Record one backward's items for the window's weighting (or that it has none); return
        what its loss is divided by: ``gradient_accumulation_steps`` for a mean loss, whose
        window is averaged over micro-batches, and 1 for a sum, which ``step()`` normalizes
        by the window's item count."""
        if self._rerunning:  # the window's items were counted on the first run
            return self._accumulation if num_items is None else 1
        if num_items is None:
            self.item_weighting.note_unweighted()
            return self._accumulation
        self.item_weighting.add(num_items)
        return 1

    def sequence_sum(self, values: torch.Tensor) -> torch.Tensor:
        """Per-sequence sums over this rank's tokens (``[batch]``, e.g. the summed log-probs
        of a preference pair's answers) as sums over the whole sequences, with gradients:
        under ``context_parallel > 1`` each rank holds a part of every sequence, and a loss
        that is not a sum over tokens (DPO's log-sigmoid of a log-prob difference) needs
        the whole. Use it inside the ``loss_fn`` of ``forward_backward`` (a mean loss,
        without ``num_items``); without context parallelism it returns ``values``.
        """
        return self.layout.context.sequence_sum(values)

    def context_parallel(self, *tensors: Any,
                         seq_dim: int | None = None) -> contextlib.AbstractContextManager[Any]:
        """A context for a hand-written step under ``context_parallel > 1``: it yields the
        tensors cut to this rank's part of the sequence (each tensor's ``seq_dim``, by
        default ``context_parallel_seq_dim``; other values pass through), and inside it
        attention (``F.scaled_dot_product_attention``) runs over the whole sequence and the
        ``context_parallel_buffers()`` hold this rank's positions. Without context
        parallelism it yields the tensors as they are, so the same step runs everywhere::

            with self.context_parallel(tokens[:, :-1], targets) as (inputs, targets):
                loss = loss_fn(self.model(inputs), targets)  # a sum over the part's items
                self.backward(loss, num_items=count)  # count: the whole sequences' items

        ``forward_backward`` and ``forward_loss`` do this themselves. Run backward inside
        the context (activation checkpointing recomputes attention there). The loss inside
        is this rank's part's; ``num_items`` counts the items of the whole sequences, as
        every rank of the ``cp`` axis computes it before the split.

        Raises:
            ValueError: if the tensors' sequence lengths differ or do not split into
                ``2 x context_parallel`` chunks (``context_parallel`` without load balancing).
        """
        return self.layout.context.split(tensors, seq_dim)

    def documents(self, document_ids: torch.Tensor, position_ids: torch.Tensor | None = None
                  ) -> contextlib.AbstractContextManager[None]:
        """A context in which attention stays inside each packed document: every
        ``F.scaled_dot_product_attention`` call over the sequence is block-causal by
        ``document_ids`` (``[batch, seq]``, what ``ShardedStream(documents=True)`` yields),
        and a transformers model called without positions gets ``position_ids``, so its
        rotary positions restart with each document::

            with self.documents(batch["document_ids"], batch["position_ids"]):
                logits = self.model(batch["input_ids"])
                loss = F.cross_entropy(logits.flatten(0, 1), batch["targets"].flatten(),
                                       reduction="sum")
                self.backward(loss, num_items=int((batch["targets"] != -100).sum()))

        Run backward inside it (activation checkpointing recomputes attention there). Under
        ``context_parallel > 1`` give it the whole sequences' ids and split the tokens inside
        it (``with self.documents(...), self.context_parallel(ids, targets) as ...``): the
        gathered attention masks keys by document as well as position, for documents of
        any length and across the cuts. Under ``pipeline_parallel > 1`` run the model through
        ``forward_backward`` inside it: each stage masks the microbatch it runs. See
        ``dream_trainer.parallel.documents``.

        Raises:
            ValueError: for shapes that are not ``[batch, seq]`` alike, attention over
                another sequence length or batch inside it, a transformers model given an
                ``attention_mask`` there, or a pipeline with context parallelism, which
                cannot keep documents apart yet.
        """
        return self.layout.documents(document_ids, position_ids, self.named_models().values())

    def _loss_context(self) -> contextlib.AbstractContextManager[Any]:
        if not self.config.device_parameters.loss_parallel:
            return contextlib.nullcontext()
        from torch.distributed.tensor.parallel import loss_parallel

        return loss_parallel()

    def step(self, model: nn.Module, optimizer: torch.optim.Optimizer,
             scheduler: LRScheduler | None = None) -> torch.Tensor:
        """Turn the window's gradients into one update, in the declared stages of
        ``step_stages.STAGES``: ``pre_optimizer_step`` hooks (where fault tolerance averages
        across replica groups), unscale (float16), normalize by the window's items (after
        ``backward(loss, num_items=n)``: the mean over every item of the global batch), the
        ``after_backward`` point (``step_points``: the gradients of a weight tied across
        pipeline stages are summed there), clip, the vote (``update_vote``: float16 overflow,
        ``NanGuard``, the fault-tolerance commit), apply (``apply_update``) when the vote
        passed, the ``after_update`` point (``MoE`` layers move their balancing bias by the
        whole step's expert load), zero the gradients, step the scheduler,
        ``post_optimizer_step`` hooks.

        Args:
            model: The model whose gradient norm is measured and clipped.
            optimizer: The optimizer to step.
            scheduler: The scheduler to step; by default the one configured for ``optimizer``.

        Returns:
            The total gradient norm before clipping, a 0-dim tensor (no host sync).

        Raises:
            RuntimeError: if called on a micro-batch that is still accumulating.
        """
        if self.is_accumulating_gradients:
            raise RuntimeError(
                f"step() called on micro-batch {self._batch_idx}, which is still accumulating "
                f"(gradient_accumulation_steps={self.training_parameters.gradient_accumulation_steps}): "
                "call it only when `not self.is_accumulating_gradients`"
            )
        if self._rerunning:
            return torch.zeros((), device=self.world.device)
        precision, points, vote = self.precision, self.step_points, self.update_vote
        self._fire("pre_optimizer_step", model, optimizer)
        # A stage the run does not use costs an attribute test here, not a call: in the loop
        # each call costs several times what it does alone.
        if precision.scaler is not None:
            precision.unscale_(optimizer)
        if self.item_weighting.active:
            self._normalize_items(model)
        if points.after_backward:
            points.run("after_backward", model, optimizer)
        grad_norm = self.layout.clip_grad_norm(
            model, self.config.training_parameters.gradient_clip_val)
        if not (vote.voters or vote.vetoes) or vote.decide(model, optimizer,
                                                            self.global_step + 1):
            self.apply_update(optimizer)
        if points.after_update:
            points.run("after_update", model, optimizer)
        optimizer.zero_grad(set_to_none=True)
        scheduler = self._scheduler_to_step(optimizer, scheduler)
        if scheduler is not None:
            scheduler.step()
        self._fire("post_optimizer_step", model, optimizer)
        return grad_norm

    @runs_on("post_train_epoch")
    def _step_schedulers_per_epoch(self, result: dict[str, Any]) -> None:
        """``scheduler_interval="epoch"``: each configured scheduler (but those stepped by a
        metric) steps once, after the epoch's last optimizer step."""
        if self.config.training_parameters.scheduler_interval != "epoch":
            return
        for scheduler in self.named_schedulers().values():
            if not takes_metric(scheduler):
                scheduler.step()

    def _declare_step_stages(self) -> None:
        """The step's own actions and voters, only those the run needs, so that what is off
        costs nothing per step (a mixin or callback adds its own the same way:
        ``step_points.add``, ``update_vote.add`` / ``veto``)."""
        self.step_points = StepPoints()
        self.update_vote = UpdateVote()
        self._schedulers_by_optimizer = {}
        self.layout.register_steps(self.step_points)
        if self.precision.scaler is not None:
            self.update_vote.add("float16_overflow",
                                 lambda model, optimizer: not self.precision.overflowed(optimizer))

    def _declare_model_stages(self) -> None:
        """The actions the built models need: the balancing bias of mixture-of-experts
        layers, moved after each update. The schedulers the optimizers step with are looked
        up again, each at its optimizer's first step."""
        self._schedulers_by_optimizer = {}
        balancing = ExpertBalancing.of(self.named_models().values(), self.world)
        if balancing is not None and "expert_balance" not in self.step_points.after_update:
            self.step_points.add("after_update", "expert_balance", balancing)

    def _scheduler_to_step(self, optimizer: torch.optim.Optimizer,
                           scheduler: LRScheduler | None) -> LRScheduler | None:
        """``scheduler``, or the one configured for ``optimizer`` (found at its first step).

        Raises:
            ValueError: for a scheduler that steps on a metric.
        """
        if scheduler is None:
            schedulers = self._schedulers_by_optimizer
            if optimizer not in schedulers:
                schedulers[optimizer] = self._scheduler_for(optimizer)
            return schedulers[optimizer]
        if takes_metric(scheduler):
            raise ValueError(
                f"step() cannot step {type(scheduler).__name__}: it steps on a metric, after "
                "each validation pass (set scheduler_monitor), not after each optimizer step"
            )
        return scheduler

    def _normalize_items(self, model: nn.Module) -> None:
        self.item_weighting.scale_gradients(model.parameters(), self.world.dp_group,
                                            self.world.gradient_ranks)

    def rerun_training_step(self, batch: Any, batch_idx: int) -> dict[str, Any]:
        """Run ``training_step`` again on micro-batch ``batch_idx`` of the current accumulation
        window, before its update, to diagnose it (``NanGuard`` does, from
        ``pre_optimizer_step``).

        It runs as the first time did (``batch_idx``, ``is_accumulating_gradients``,
        ``local_batches`` and ``global_step`` as they were, under the same autocast), except
        that ``backward()`` counts no items, ``step()`` does nothing and returns a zero
        tensor, no hook fires, and every model runs on this rank alone (no gradient
        synchronisation, no buffer broadcast: ``Layout.local_pass``). The
        gradients still accumulate into ``.grad`` and modules may update their own state
        (running statistics, for one); saving and restoring those, and the random generators,
        is the caller's part.

        Args:
            batch: The micro-batch, as ``pre_train_batch`` received it (on the device).
            batch_idx: Its index, one of the current window's.

        Returns:
            What ``training_step`` returned.

        Raises:
            RuntimeError: outside training, or under a pipeline or FSDP2 (whose passes are
                collective).
            ValueError: if ``batch_idx`` is not in the current window.
        """
        accumulation = self.training_parameters.gradient_accumulation_steps
        first = self._batch_idx - self._batch_idx % accumulation
        if not self.training:
            raise RuntimeError("rerun_training_step() runs during training only")
        local = self.layout.local_pass(self.named_models().values())
        if not first <= batch_idx <= self._batch_idx:
            raise ValueError(f"rerun_training_step(batch_idx={batch_idx}): the current window "
                             f"holds batches {first}-{self._batch_idx}")
        saved = self._batch_idx, self.local_batches
        self.local_batches -= self._batch_idx - batch_idx
        self._batch_idx, self._rerunning = batch_idx, True
        try:
            with local, self.precision.autocast():
                return check_result(self.training_step(batch, batch_idx), "training_step")
        finally:
            (self._batch_idx, self.local_batches), self._rerunning = saved, False

    def apply_update(self, optimizer: torch.optim.Optimizer) -> None:
        """Apply the gradients: ``optimizer.step()``, through the gradient scaler with float16.

        ``step()`` calls this after clipping, when the vote passed (``update_vote``: whether an
        update happens is decided there, not here), and before zeroing the gradients.
        """
        if self.precision.scaler is None:  # no call through Precision: as in step()
            optimizer.step()
        else:
            self.precision.step(optimizer)

    def _scheduler_for(self, optimizer: torch.optim.Optimizer) -> LRScheduler | None:
        if self.config.training_parameters.scheduler_interval == "epoch":
            return None  # stepped by _step_schedulers_per_epoch
        for scheduler in self.named_schedulers().values():
            if scheduler.optimizer is optimizer and not takes_metric(scheduler):
                return scheduler
        return None
