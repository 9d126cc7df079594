"""Where and how to run: mesh degrees, precision, compilation, timeouts."""

from __future__ import annotations

import math
from collections.abc import Mapping
from datetime import timedelta
from typing import Annotated, Any, Literal

import torch
from pydantic import (BeforeValidator, NonNegativeInt, PlainSerializer, PositiveInt,
                      WithJsonSchema, model_validator)

from dream_trainer.configs.activation_policy import ActivationCheckpointing, policy_label
from dream_trainer.configs.base import ConfigModel

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}


def _parse_dtype(value: Any) -> torch.dtype:
    if isinstance(value, torch.dtype):
        if value in _DTYPES.values():
            return value
        value = str(value).removeprefix("torch.")
    if isinstance(value, str) and value.removeprefix("torch.") in _DTYPES:
        return _DTYPES[value.removeprefix("torch.")]
    raise ValueError(
        f"unknown dtype {value!r}: use one of {sorted(set(_DTYPES))} or the matching torch.dtype"
    )


TorchDType = Annotated[
    torch.dtype,
    BeforeValidator(_parse_dtype),
    PlainSerializer(lambda dtype: str(dtype).removeprefix("torch."), return_type=str),
    WithJsonSchema({"type": "string", "enum": sorted(_DTYPES)}),
]
"""A floating dtype given as ``torch.bfloat16`` or a name such as ``"bf16"``; serialized by name."""

Degree = PositiveInt | Literal["auto"]
"""A mesh degree: a positive size, or ``"auto"`` for whatever the world size leaves over."""

MESH_DEGREES: dict[str, str] = {"pipeline_parallel": "pp", "dp_replicate": "dp_replicate",
                                "dp_shard": "dp_shard", "context_parallel": "cp",
                                "tensor_parallel": "tp"}
"""The ``DeviceParameters`` fields that size the mesh, outermost axis first (tensor parallel
innermost, so that its frequent collectives stay on the fastest links), each with its short
name: the mesh axis and the ``ParallelDims`` attribute. The one list of them."""

DEGREES: dict[str, str] = {**MESH_DEGREES, "expert_parallel": "ep"}
"""Every parallel degree: the mesh's, and expert parallelism, which borrows its ranks from
``dp_shard x context_parallel``."""

PipelineSchedule = Literal["GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS",
                           "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV"]
"""The ``torch.distributed.pipelining`` schedules a pipeline can run."""

Float8Recipe = Literal["tensorwise", "rowwise", "rowwise_with_gw_hp"]
"""torchao's float8 training recipes (``Float8LinearConfig.from_recipe_name``)."""

DEFAULT_FLOAT8_FILTER: tuple[str, ...] = ("output", "head", "lm_head", "router", "gate")
"""Module names kept in high precision by default: the usual names of an output head and of
a mixture of experts' router (``dream_trainer.nn.MoE``'s ``router``; ``gate`` in transformers'
MoE blocks, whose dense MLPs' ``gate_proj`` is another name and converts)."""

_EARLIER_FLOAT8_FILTERS = {("output", "head", "lm_head")}
"""Defaults of earlier releases, which the configurations they dumped hold."""

SINGLE_STAGE_SCHEDULES = frozenset({"GPipe", "1F1B"})
"""Schedules that run exactly one stage per rank."""
V_SCHEDULES = frozenset({"ZBVZeroBubble", "DualPipeV"})
"""Schedules that run two stages per rank placed in a V: rank r holds stages r and 2p-1-r."""


def pipeline_layout(params: DeviceParameters, degree: int) -> tuple[int, int]:
    """``(stages per rank, microbatches)`` for a pipeline of ``degree`` ranks, defaults resolved.

    ``pipeline_stages_per_rank=None`` is 1 for GPipe and 1F1B and 2 for the others;
    ``pipeline_microbatches=None`` is ``degree`` x stages per rank.
    """
    stages_per_rank = params.pipeline_stages_per_rank
    if stages_per_rank is None:
        stages_per_rank = 1 if params.pipeline_schedule in SINGLE_STAGE_SCHEDULES else 2
    microbatches = params.pipeline_microbatches
    return stages_per_rank, degree * stages_per_rank if microbatches is None else microbatches


def fixed_pipeline_microbatches(params: DeviceParameters) -> int:
    """The microbatches a pipeline of a fixed degree cuts each batch into, for the config to
    check its batch sizes by; 1 without a pipeline, and for ``pipeline_parallel="auto"``, whose
    batches setup checks by the same rule once the degree is resolved (``ParallelDims``)."""
    degree = params.pipeline_parallel
    if degree == "auto" or degree == 1:
        return 1
    return pipeline_layout(params, degree)[1]


def ddp_pipeline_problem(pipeline_parallel: Any, dp_replicate: Any) -> str:
    """Why DDP replicas of pipeline stages are refused, and what to set instead."""
    # torch 2.13's pipeline stages fail inside DDP's reducer from the second micro-batch on;
    # FSDP2 (and HSDP) stages work.
    return (f"pipeline_parallel={pipeline_parallel!r} with dp_replicate={dp_replicate!r} "
            "would wrap pipeline stages in DDP, which torch's pipelining cannot run: shard "
            "them instead with dp_replicate=1 and dp_shard='auto' (FSDP2), or dp_shard with "
            "dp_replicate (HSDP)")


def pipeline_problem(schedule: str, degree: int, stages_per_rank: int,
                     microbatches: int) -> str | None:
    """Why these pipeline settings cannot run together, or None when they can.

    Args:
        schedule: The ``pipeline_schedule``.
        degree: The resolved ``pipeline_parallel`` degree.
        stages_per_rank: The resolved ``pipeline_stages_per_rank``.
        microbatches: The resolved ``pipeline_microbatches``.
    """
    stages = degree * stages_per_rank
    if schedule in SINGLE_STAGE_SCHEDULES and stages_per_rank != 1:
        return (f"pipeline_schedule={schedule!r} runs one stage per rank but "
                f"pipeline_stages_per_rank={stages_per_rank}: set pipeline_stages_per_rank=1, "
                "or choose 'Interleaved1F1B' for several stages per rank")
    if schedule in V_SCHEDULES and stages_per_rank != 2:
        return (f"pipeline_schedule={schedule!r} places exactly 2 stages per rank in a V but "
                f"pipeline_stages_per_rank={stages_per_rank}: set pipeline_stages_per_rank=2 "
                "(or leave it unset)")
    if schedule in ("1F1B", "DualPipeV") and microbatches < stages:
        return (f"pipeline_schedule={schedule!r} needs at least one microbatch per stage, but "
                f"pipeline_microbatches={microbatches} < {stages} stages (pipeline_parallel="
                f"{degree} x pipeline_stages_per_rank={stages_per_rank}): raise "
                "pipeline_microbatches")
    if schedule in ("Interleaved1F1B", "InterleavedZeroBubble"):
        rounds = max(1, microbatches // degree)
        if microbatches % rounds:
            return (f"pipeline_schedule={schedule!r} runs microbatches in rounds of "
                    f"pipeline_parallel={degree}, but pipeline_microbatches={microbatches} is "
                    f"not a multiple of its {rounds} rounds: use a multiple of {degree}")
    return None


def degree_problem(params: DeviceParameters, degrees: Mapping[str, Degree]) -> str | None:
    """Why ``params`` cannot run with these mesh degrees, or None when it can.

    The config checks its own degrees and skips each rule that reads an ``"auto"`` one;
    ``ParallelDims.resolve`` checks the resolved degrees, so that an ``"auto"`` degree meets
    every rule a fixed one does once the world size is known.

    Args:
        params: The settings the rules read besides the degrees (offload, loss parallel,
            the pipeline's dtype and schedule, expert parallelism).
        degrees: A degree (or ``"auto"``) for each of ``dp_replicate``, ``dp_shard``,
            ``context_parallel``, ``tensor_parallel`` and ``pipeline_parallel``.
    """
    pp, dp_replicate, dp_shard, cp, tp = (degrees[name] for name in (
        "pipeline_parallel", "dp_replicate", "dp_shard", "context_parallel", "tensor_parallel"))
    if params.cpu_offload and dp_shard == 1 and cp == 1:
        return ("cpu_offload=True needs FSDP2 sharding: set dp_shard > 1 (or 'auto' on several "
                "ranks) or context_parallel > 1 (FSDP2 shards over dp_shard x context_parallel), "
                "or turn cpu_offload off")
    if params.loss_parallel and tp == 1:
        return ("loss_parallel=True computes the loss over vocabulary-sharded logits, which "
                "needs tensor_parallel > 1: set tensor_parallel, or turn loss_parallel off")
    if isinstance(pp, int) and pp > 1:
        if params.param_dtype == torch.float16:
            # Each stage's gradient scaler would skip steps on its own overflows, so the
            # stages would drift apart.
            return ("pipeline_parallel > 1 cannot run with param_dtype=float16 (its gradient "
                    "scaler would skip steps stage by stage): use bfloat16")
        if isinstance(dp_replicate, int) and dp_replicate > 1 and dp_shard == 1 and cp == 1:
            return ddp_pipeline_problem(pp, dp_replicate)
        problem = pipeline_problem(params.pipeline_schedule, pp, *pipeline_layout(params, pp))
        if problem is not None:
            return problem
    return _expert_parallel_problem(params, degrees)


def _expert_parallel_problem(params: DeviceParameters,
                             degrees: Mapping[str, Degree]) -> str | None:
    """Why ``expert_parallel`` cannot borrow its ranks from these degrees, or None. It
    borrows every context-parallel rank (their tokens differ, as data-parallel ranks' do,
    and torchtitan does the same) and ``ep / cp`` of the ``dp_shard`` ranks; tensor- and
    pipeline-parallel ranks and replicas each hold all of an ``ep`` group's experts."""
    ep, dp_shard, cp = (params.expert_parallel, degrees["dp_shard"],
                        degrees["context_parallel"])
    if ep == 1 or cp == "auto":
        return None
    if ep % cp:
        return (f"expert_parallel={ep} with context_parallel={cp}: expert parallelism borrows "
                "every context-parallel rank (they hold different tokens) and the rest from "
                f"dp_shard, so expert_parallel must be a multiple of {cp}: set it to one, or "
                "change context_parallel")
    lent = ep // cp
    if not isinstance(dp_shard, int) or dp_shard % lent == 0:
        return None
    source = "dp_shard" if cp == 1 else f"dp_shard (and context_parallel={cp})"
    problem = (f"expert_parallel={ep} borrows its ranks from {source}, so dp_shard must be a "
               f"multiple of {lent}, got dp_shard={dp_shard!r}")
    if params.dp_shard != "auto":
        return f"{problem}: set dp_shard to a multiple of {lent} or 'auto'"
    # dp_shard='auto' took the ranks the world size leaves: only another world size or
    # another expert_parallel can change it.
    others = math.prod(int(degree) for name, degree in degrees.items() if name != "dp_shard")
    divisors = [cp * d for d in range(1, dp_shard + 1) if dp_shard % d == 0]
    return (f"{problem}: dp_shard='auto' takes the ranks the other degrees leave, so launch "
            f"a multiple of {others * lent} processes, or set expert_parallel to one of "
            f"{divisors}")


class DeviceParameters(ConfigModel):
    """The device mesh and the numerics of a run.

    The mesh degrees multiply to the world size; at most one may be ``"auto"``. They are
    resolved against the real world size by ``DistributedWorld``, never written back here.
    """

    dp_replicate: Degree = 1
    """Data-parallel replicas (DDP, or the replicate axis of HSDP). When not given it is
    ``"auto"`` unless another degree is, so the default is data parallel over every rank.
    A value derived so stays out of ``model_fields_set`` and follows the fields given,
    however they are given (keywords, JSON, a command-line override)."""
    dp_shard: Degree = 1
    """Data-parallel shards (FSDP2). When neither this nor ``dp_replicate`` is given and
    ``pipeline_parallel > 1`` (or ``expert_parallel > 1``), it is ``"auto"``: a pipeline's
    spare ranks shard its stages."""
    context_parallel: Degree = 1
    """Context-parallel degree: each sequence is split over this many ranks along
    ``context_parallel_seq_dim``, and attention gathers the keys and values of the whole
    sequence from them (see the parallelism guide). The ranks hold the same weights, which
    FSDP2 shards over ``dp_shard`` x ``context_parallel``. A batch's sequence length must
    divide into ``2 x context_parallel`` chunks (``context_parallel`` without load balancing)."""
    context_parallel_seq_dim: int = 1
    """The sequence dimension of every tensor input and target that ``forward_backward`` and
    ``forward_loss`` split under ``context_parallel > 1`` (1 for ``[batch, sequence, ...]``)."""
    context_parallel_load_balance: bool = True
    """Give each context-parallel rank one chunk from the head of the sequence and one from
    the tail, so that under causal attention every rank has the same work; ``False`` gives
    rank r the r-th contiguous chunk."""
    tensor_parallel: Degree = 1
    """Tensor-parallel degree."""
    pipeline_parallel: Degree = 1
    """Pipeline-parallel degree: the model's blocks are split into stages over this many
    ranks (see ``SetupMixin.apply_pipeline_parallel``)."""
    expert_parallel: PositiveInt = 1
    """Expert-parallel degree: the routed experts of every ``dream_trainer.nn.MoE`` layer are
    split over this many ranks, which exchange tokens by all-to-all (see
    ``SetupMixin.apply_expert_parallel``). It borrows its ranks from ``dp_shard`` x
    ``context_parallel`` and does not change the world size: it must be a multiple of
    ``context_parallel`` (it borrows every cp rank) and ``dp_shard`` a multiple of
    ``expert_parallel / context_parallel`` (FSDP2 then shards each rank's experts over the
    ``dp_shard x context_parallel / expert_parallel`` ranks left, ``efsdp``, the other
    weights over all of ``dp_shard x context_parallel``), and every MoE layer's
    ``num_experts`` a multiple of it. Tensor- and pipeline-parallel ranks and ``dp_replicate``
    replicas each hold all the experts of their ``ep`` group (the experts are not
    tensor-parallel). When neither ``dp_replicate`` nor ``dp_shard`` is given, ``dp_shard`` is
    ``"auto"``."""
    device: Literal["auto", "cpu", "cuda", "mps"] = "auto"
    """``"auto"`` uses CUDA when available, else MPS (Apple silicon) when torch reports it
    and the run has one process, else the CPU. ``"mps"`` runs one process only: gloo, the
    backend of processes without CUDA, cannot move MPS tensors between them."""
    param_dtype: TorchDType = torch.float32
    """dtype of parameters in forward and backward (mixed precision when not float32)."""
    reduce_dtype: TorchDType = torch.float32
    """dtype of gradient reduction across data-parallel ranks."""
    compile_model: bool = False
    """Compile each model with ``torch.compile``."""
    checkpoint_activations: bool = False
    """The earlier switch, kept as a synonym: ``True`` is ``activation_checkpointing="full"``
    (with any other policy it is an error); ``False`` leaves the choice to
    ``activation_checkpointing``."""
    activation_checkpointing: ActivationCheckpointing = None
    """Which activations a step recomputes in backward instead of keeping them from forward,
    block by block (``find_blocks``): ``None`` keeps them all; ``"full"`` recomputes every
    block; an int N recomputes blocks 0, N, 2N, ... whole (1 is ``"full"``); ``"selective"``
    recomputes every block but for the outputs of its matrix products, attention and
    collectives; a policy function ``(ctx, op, *args, **kwargs) -> CheckpointPolicy``
    (torch's selective checkpointing) chooses op by op in every block. Set to ``"full"``
    when only ``checkpoint_activations=True`` is given (a derived value, outside
    ``model_fields_set``). A function is dumped to JSON by its qualified name."""
    activation_offload: bool = False
    """Move what each block (``find_blocks``) saves for backward to host memory during
    forward, and bring it back in backward (torch's saved-tensor hooks; on CUDA pinned memory
    and a side stream). With ``"full"`` or an int N it offloads what the checkpoints keep (the
    checkpointed blocks' inputs) and all that the other blocks save. Parameters and tensor
    subclasses (DTensor, float8) stay where they are. Not with an op-level policy
    (``"selective"``, a function) nor with ``compile_model``."""
    cpu_offload: bool = False
    """Keep FSDP2-sharded parameters, gradients and optimizer state on the CPU. FSDP2 applies
    when ``dp_shard x context_parallel > 1``, so it needs one of them above 1."""
    init_timeout: timedelta = timedelta(minutes=10)
    """Collective timeout while the process group starts up and the model is set up."""
    train_timeout: timedelta = timedelta(minutes=5)
    """Collective timeout once the first training step has finished."""
    flight_recorder_entries: NonNegativeInt | None = None
    """Collectives the flight recorder keeps per process (its ring buffer), which
    ``HangWatchdog`` dumps when it ends a hung rank; ``0`` turns it off. Sets
    ``TORCH_FR_BUFFER_SIZE`` (formerly ``TORCH_NCCL_TRACE_BUFFER_SIZE``) before the process
    group starts. ``None`` leaves the environment, and so torch's default (torch 2.13
    records), as it is."""
    detect_anomaly: bool = False
    """Run ``fit()`` under ``torch.autograd.set_detect_anomaly(True)``: backward names the
    forward operation that produced a NaN or a failing gradient (slow: for debugging)."""
    pipeline_schedule: PipelineSchedule = "1F1B"
    """The pipeline schedule (``torch.distributed.pipelining``), used when
    ``pipeline_parallel > 1``."""
    pipeline_microbatches: PositiveInt | None = None
    """Microbatches each micro-batch is split into along dim 0 (``train_batch_size`` and
    ``val_batch_size`` must divide by it); ``None`` uses ``pipeline_parallel`` x
    ``pipeline_stages_per_rank``."""
    pipeline_stages_per_rank: PositiveInt | None = None
    """Stages each pipeline rank holds (virtual stages of the interleaved and V schedules);
    ``None`` uses 1 for GPipe and 1F1B, 2 for the others."""
    loss_parallel: bool = False
    """Compute the loss of ``forward_backward``/``forward_loss`` inside torch's
    ``loss_parallel()``: cross-entropy over logits sharded on the vocabulary dimension
    (a DTensor ``Shard(-1)``) without gathering them. Needs ``tensor_parallel > 1``."""
    float8_recipe: Float8Recipe | None = None
    """Train the models' ``nn.Linear`` layers in float8 with torchao (extra ``[float8]``):
    ``"tensorwise"`` (one scale per tensor; with ``dp_shard > 1`` FSDP2 all-gathers the
    weights in float8), ``"rowwise"`` (a scale per row) or ``"rowwise_with_gw_hp"`` (rowwise,
    with the weight gradient computed in high precision). Weights, gradients, optimizer
    state and checkpoints stay in ``param_dtype``. Without float8 hardware (a CPU, or CUDA
    capability below 8.9) the float8 matmuls are emulated: same numerics, no speed-up."""
    float8_filter: tuple[str, ...] = DEFAULT_FLOAT8_FILTER
    """Module names kept in high precision when ``float8_recipe`` is set: an entry matches a
    module when it is a run of whole components of the module's name (``"head"`` keeps
    ``head``, ``model.head`` and everything under them; ``"layers.0"`` the first block). The
    default keeps the usual names of an output head and of an MoE router, whose scores pick
    the experts (with 16 or more experts a router's shape would convert). Linear layers whose
    ``in_features`` or ``out_features`` is not a multiple of 16 always stay in high precision
    (float8 matmuls need it)."""

    @model_validator(mode="after")
    def _default_data_parallel(self) -> DeviceParameters:
        # The data-parallel degrees not given follow from the fields that were, however the
        # config was built (keywords, JSON, apply_cli_overrides' copy of the given fields with
        # one changed). They stay out of model_fields_set, so that such a copy derives them
        # anew instead of taking a derived default for a choice.
        given = self.model_fields_set
        if "dp_replicate" in given:
            return self
        dp_replicate: Degree = "auto"
        dp_shard: Degree = self.dp_shard if "dp_shard" in given else 1
        if any(getattr(self, name) == "auto" for name in MESH_DEGREES if name in given):
            dp_replicate = 1  # the "auto" degree given takes the spare ranks
        elif (self.pipeline_parallel != 1 or self.expert_parallel != 1) \
                and "dp_shard" not in given:
            # Pipeline stages cannot be DDP-wrapped (see ddp_pipeline_problem), so a
            # pipeline's spare ranks shard its stages, as torchtitan's do; expert
            # parallelism borrows its ranks from dp_shard.
            dp_replicate, dp_shard = 1, "auto"
        object.__setattr__(self, "dp_replicate", dp_replicate)
        object.__setattr__(self, "dp_shard", dp_shard)
        return self

    @model_validator(mode="after")
    def _checkpoint_activations_synonym(self) -> DeviceParameters:
        if not self.checkpoint_activations:
            return self
        if self.activation_checkpointing is None:
            object.__setattr__(self, "activation_checkpointing", "full")
        elif self.activation_checkpointing != "full":
            raise ValueError(
                "checkpoint_activations=True means activation_checkpointing='full', but "
                f"activation_checkpointing={policy_label(self.activation_checkpointing)!r} "
                "was given too: drop checkpoint_activations or set it False "
                "(activation_checkpointing alone chooses the policy)")
        return self

    @model_validator(mode="after")
    def _check_degrees(self) -> DeviceParameters:
        autos = [name for name in MESH_DEGREES if getattr(self, name) == "auto"]
        if len(autos) > 1:
            raise ValueError(
                f"{' and '.join(autos)} are each 'auto': at most one mesh degree can be 'auto'; "
                "give the others explicit sizes"
            )
        if self.init_timeout <= timedelta(0) or self.train_timeout <= timedelta(0):
            raise ValueError("init_timeout and train_timeout must be positive durations")
        problem = degree_problem(self, {name: getattr(self, name) for name in MESH_DEGREES})
        if problem is not None:
            raise ValueError(problem)
        self._check_float8()
        self._check_activation_offload()
        return self

    def _check_activation_offload(self) -> None:
        if not self.activation_offload:
            return
        policy = self.activation_checkpointing
        if policy == "selective" or callable(policy):
            # torch's selective checkpoint caches the outputs it keeps in its own dispatch
            # mode, past any saved-tensor hooks: they would stay on the device.
            raise ValueError(
                f"activation_offload=True cannot move what activation_checkpointing="
                f"{policy_label(policy)!r} keeps (an op-level policy caches the outputs it "
                "saves outside the saved-tensor hooks): use activation_checkpointing='full' "
                "or an int N, or turn activation_offload off")
        if self.compile_model:
            raise ValueError(
                "activation_offload=True with compile_model=True is not supported "
                "(torch.compile would trace the saved-tensor hooks around each block, which "
                "is not verified): turn one of them off")

    def _check_float8(self) -> None:
        if self.float8_recipe is None:
            # Compared with the default, not model_fields_set: a dumped and re-read config
            # sets every field.
            if self.float8_filter != DEFAULT_FLOAT8_FILTER \
                    and self.float8_filter not in _EARLIER_FLOAT8_FILTERS:
                raise ValueError("float8_filter is set but float8_recipe is None, so nothing "
                                 "is converted to float8: set float8_recipe ('tensorwise', "
                                 "'rowwise' or 'rowwise_with_gw_hp'), or drop float8_filter")
            return
        for entry in self.float8_filter:
            parts = entry.split(".")
            if not entry or any(not part or part != part.strip() for part in parts):
                raise ValueError(f"float8_filter entry {entry!r} is not a module name: give "
                                 "dotted names such as 'head' or 'layers.0.mlp'")

    @classmethod
    def SINGLE_DEVICE(cls, **overrides: Any) -> DeviceParameters:
        """One process, no parallelism (a world size above 1 is an error)."""
        return cls(dp_replicate=1, **overrides)

    @classmethod
    def DDP(cls, **overrides: Any) -> DeviceParameters:
        """Replicate the model on every rank and all-reduce gradients."""
        return cls(dp_replicate="auto", **overrides)

    @classmethod
    def FSDP(cls, **overrides: Any) -> DeviceParameters:
        """Shard parameters, gradients and optimizer state over every rank (FSDP2)."""
        return cls(dp_replicate=1, dp_shard="auto", **overrides)

    @classmethod
    def HSDP(cls, dp_shard: PositiveInt, **overrides: Any) -> DeviceParameters:
        """Shard within groups of ``dp_shard`` ranks and replicate across the groups."""
        return cls(dp_replicate="auto", dp_shard=dp_shard, **overrides)
