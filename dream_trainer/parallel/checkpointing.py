"""Activation checkpointing by policy: which blocks recompute their activations in backward,
and, under an op-level policy, which of their operations' outputs they keep.

Every policy wraps blocks (``find_blocks``) in torch's ``CheckpointWrapper``
(``torch.utils.checkpoint.checkpoint`` with ``use_reentrant=False``); an op-level policy
("selective", or a policy function) adds ``create_selective_checkpoint_contexts`` as the
checkpoint's ``context_fn``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from dream_trainer.configs.activation_policy import (CheckpointingPolicy, PolicyFunction,
                                                     policy_label)
from dream_trainer.parallel.blocks import find_blocks


def _overloads(namespace: str, names: Iterable[str]) -> frozenset[Any]:
    """The ``.default`` overloads of the ops ``names`` that this torch build has: torch 2.6,
    the oldest supported, lacks the grouped products, and a build without distributed
    support lacks the functional collectives."""
    ops = getattr(torch.ops, namespace)
    found = (getattr(ops, name, None) for name in names)
    return frozenset(op.default for op in found if op is not None)


SELECTIVE_SAVE_OPS: frozenset[Any] = _overloads("aten", (
    # Matrix products: most of a block's compute, and so the costliest to recompute.
    "mm", "addmm", "bmm", "baddbmm", "_scaled_mm", "_grouped_mm", "_scaled_grouped_mm",
    # Attention, each kernel torch's scaled_dot_product_attention may dispatch to.
    "_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
    "_scaled_dot_product_fused_attention_overrideable",
    # A whole tensor's max is float8 scaling's amax: a scalar, kept so that the recomputed
    # scale is the one forward used.
    "max",
)) | _overloads("_c10d_functional", (
    # Tensor parallelism's collectives: recomputing them would communicate again.
    "all_reduce", "reduce_scatter_tensor", "all_gather_into_tensor",
))
"""The operations whose outputs the ``"selective"`` policy keeps; it recomputes the rest
(norms, activations, elementwise arithmetic), which are cheap beside them."""


def keep_products_and_attention(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
    """The ``"selective"`` policy: keep the outputs of ``SELECTIVE_SAVE_OPS``, recompute the
    rest (torch's ``CheckpointPolicy``)."""
    from torch.utils.checkpoint import CheckpointPolicy

    if op in SELECTIVE_SAVE_OPS:
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def checkpoint_blocks(model: nn.Module, policy: CheckpointingPolicy) -> int:
    """Wrap ``model``'s blocks (``find_blocks``) for recomputation as ``policy`` says, in
    place: every block, or under an int N the blocks 0, N, 2N, ... in ``find_blocks``
    order; nothing for None.

    Returns:
        How many blocks were wrapped.
    """
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        checkpoint_wrapper)

    if policy is None:
        return 0
    every = policy if isinstance(policy, int) else 1
    context_fn = _context_fn(policy)
    kwargs = {} if context_fn is None else {"context_fn": context_fn}
    wrapped = 0
    for index, (container, name, block) in enumerate(find_blocks(model)):
        if index % every == 0:
            setattr(container, name, checkpoint_wrapper(block, **kwargs))
            wrapped += 1
    return wrapped


def _context_fn(policy: CheckpointingPolicy) -> Callable[[], Any] | None:
    """The checkpoint's ``context_fn`` for an op-level policy; None when blocks are
    recomputed whole."""
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    function: PolicyFunction | None
    if policy == "selective":
        function = keep_products_and_attention
    elif callable(policy):
        function = policy
    else:
        return None
    _ignore_profiler_annotations()
    return functools.partial(create_selective_checkpoint_contexts, function)


def _ignore_profiler_annotations() -> None:
    """Let op-level checkpointing pass over ``record_function``'s ops, as it does over
    ``detach``: they annotate, compute nothing, and need not repeat in the recomputation.

    An op-level policy replays each op's n-th call in backward from what forward cached,
    counting calls per op, so an op called more often in the recomputation fails the step
    ("invocation index ... not found in storage"). FSDP2 annotates its hooks with
    ``record_function`` and, on a unit inside a checkpointed block (the experts under
    expert parallelism), runs them a different number of times in the recomputation
    (torchtitan issue 3427; torch 2.13 does not skip them yet). torch consults its module
    set ``SAC_IGNORED_OPS`` for the ops it passes over; they are added to it once.
    """
    import torch.utils.checkpoint as checkpoint

    ignored = getattr(checkpoint, "SAC_IGNORED_OPS", None)
    if isinstance(ignored, set):
        ignored |= _PROFILER_OPS


_PROFILER_OPS = frozenset(
    op for op in (getattr(torch.ops.profiler._record_function_enter_new, "default", None),
                  getattr(torch.ops.profiler._record_function_exit, "_RecordFunction", None))
    if op is not None)
"""``record_function``'s ops: entering (``.default``) and leaving (``._RecordFunction``)."""


def describe_policy(policy: CheckpointingPolicy) -> str:
    """What ``policy`` recomputes, in a few words (summaries and ``summarize``)."""
    if policy is None:
        return "nothing recomputed"
    if policy == "full" or policy == 1:
        return "every block recomputed"
    if isinstance(policy, int):
        suffix = {1: "st", 2: "nd", 3: "rd"}.get(policy % 10 * (policy % 100 // 10 != 1), "th")
        return (f"every {policy}{suffix} block recomputed (blocks 0, {policy}, {2 * policy}, "
                "...)")
    if policy == "selective":
        return ("every block recomputed but the outputs of its matrix products, attention "
                "and collectives")
    return f"every block recomputed op by op as {policy_label(policy)} chooses"
