"""Where a non-finite value came from: ``NanGuard``'s re-run of a window's micro-batches with
hooks on every module, and the report it makes."""

from __future__ import annotations

import functools
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle
from typing_extensions import Self

from dream_trainer.checkpoint.rng import rng_state, set_rng_state
from dream_trainer.data.batch import move_to_device
from dream_trainer.parallel.names import clean_name, unwrap_ddp
from dream_trainer.trainer.abstract import AbstractTrainer

FindingKind = Literal["forward", "backward", "loss", "batch", "value", "finite", "error"]
"""What a rank found: a module's output (``"forward"``) or input or parameter gradient
(``"backward"``) became non-finite; the loss did, outside every module (``"loss"``); the
micro-batch itself holds NaN or inf (``"batch"``); a checked value was non-finite on a step
whose window is gone, so nothing was re-run (``"value"``); the re-run stayed finite
(``"finite"``); or the re-run raised (``"error"``)."""

CULPRIT_KINDS: frozenset[str] = frozenset({"forward", "backward", "loss", "batch", "value"})
"""The kinds that name a non-finite value on that rank."""


@dataclass(frozen=True)
class NanFinding:
    """What one rank found about a non-finite step (one line of a ``NanReport``)."""

    rank: int
    kind: FindingKind
    step: int
    """The global step the value belongs to, as ``training_step`` saw ``global_step``."""
    epoch: int
    batch_idx: int | None
    """The micro-batch re-run or named, where there is one."""
    module: str | None = None
    """The qualified name of the module that produced the value (``"model.blocks.2.mlp"``),
    for ``"forward"`` and ``"backward"``; the model whose output received it, for
    ``"loss"``."""
    module_type: str | None = None
    detail: str = ""
    batch_file: Path | None = None
    """Where the offending micro-batch was saved (``torch.load`` it)."""

    def __str__(self) -> str:
        where = f"rank {self.rank}" if self.batch_idx is None \
            else f"rank {self.rank}, batch {self.batch_idx}"
        module = f"{self.module} ({self.module_type}) " if self.kind in ("forward", "backward") \
            else ""
        saved = f"; batch saved to {self.batch_file}" if self.batch_file is not None else ""
        return f"{where}: {module}{self.detail}{saved}"


@dataclass(frozen=True)
class NanReport:
    """Every rank's finding about one non-finite optimizer step, in rank order; its text is
    the error's message."""

    step: int
    epoch: int
    findings: tuple[NanFinding, ...]

    @property
    def culprits(self) -> tuple[NanFinding, ...]:
        """The findings of the ranks where a non-finite value appeared."""
        return tuple(f for f in self.findings if f.kind in CULPRIT_KINDS)

    @property
    def ranks(self) -> list[int]:
        """The ranks where a non-finite value appeared."""
        return [finding.rank for finding in self.culprits]

    def __str__(self) -> str:
        culprits = self.culprits
        if culprits:
            first = min(culprits, key=lambda finding: (finding.step, finding.rank))
            batch = "" if first.batch_idx is None else f"batch {first.batch_idx} of "
            ranks = ", ".join(map(str, self.ranks))
            head = (f"non-finite values at global step {first.step} ({batch}epoch "
                    f"{first.epoch}) on rank{'s' if len(culprits) > 1 else ''} {ranks}:")
        else:
            head = (f"non-finite values at global step {self.step} (epoch {self.epoch}), on "
                    "no rank when re-run:")
        others = [finding for finding in self.findings if finding not in culprits]
        advice = ("Look for a too-high learning rate, a log or division of zero, or bad data "
                  "in that batch; NanGuard(mode='skip') skips such steps instead")
        return "\n".join([head, *(f"  {finding}" for finding in (*culprits, *others)), advice])


@dataclass(frozen=True)
class MicroBatch:
    """One micro-batch of the current window as ``training_step`` received it, and the
    random generators' state at its start, kept so that a re-run draws the same dropout."""

    batch: Any
    batch_idx: int
    cpu_rng: torch.Tensor
    cuda_rng: torch.Tensor | None

    @classmethod
    def capture(cls, batch: Any, batch_idx: int, device: torch.device) -> MicroBatch:
        """A reference to ``batch`` and a copy of the generator states (a few KiB)."""
        cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
        return cls(batch, batch_idx, torch.get_rng_state(), cuda)

    def restore_rng(self, device: torch.device) -> None:
        torch.set_rng_state(self.cpu_rng)
        if self.cuda_rng is not None:
            torch.cuda.set_rng_state(self.cuda_rng, device)

    def save(self, path: Path, step: int, epoch: int, rank: int) -> Path:
        """Write the batch (on the CPU), where it was and its generator states to ``path``:
        ``torch.load(path, weights_only=True)`` reads it back for plain tensor batches."""
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save({"batch": move_to_device(self.batch, torch.device("cpu")),
                    "batch_idx": self.batch_idx, "global_step": step, "epoch": epoch,
                    "rank": rank, "cpu_rng_state": self.cpu_rng,
                    "cuda_rng_state": self.cuda_rng}, path)
        return path


def diagnose_window(trainer: AbstractTrainer, window: Sequence[MicroBatch], keys: Iterable[str],
                    step: int, batch_path: Path) -> NanFinding:
    """Re-run ``window`` in order from the state before its update, with hooks on every
    module, until a micro-batch shows a non-finite value; save that micro-batch to
    ``batch_path``. Everything the re-run touches is put back: gradients, buffers, module
    attributes (train/eval mode included), the random generators; hooks are removed.

    Call it from ``pre_optimizer_step`` (``trainer.rerun_training_step`` runs each one).
    """
    world = trainer.world
    models = trainer.named_models()
    saved = _SavedState(models.values())
    probe = _Probe(models)
    micro: MicroBatch | None = None
    try:
        # Eager: hooks that read values on the host would break compiled graphs apart.
        with torch.compiler.set_stance("force_eager"), probe:
            for micro in window:
                probe.check_batch(micro.batch)
                micro.restore_rng(world.device)
                try:
                    result = trainer.rerun_training_step(micro.batch, micro.batch_idx)
                except Exception as error:  # noqa: BLE001 - reported, never raised from here
                    probe.failed(error)
                else:
                    probe.check_result(result, keys)
                if probe.found is not None:
                    break
    finally:
        saved.restore()
    epoch = trainer.current_epoch
    if probe.found is None or micro is None:
        batches = f"{window[0].batch_idx}-{window[-1].batch_idx}" if len(window) > 1 \
            else str(window[0].batch_idx) if window else "none kept"
        return NanFinding(world.rank, "finite", step, epoch, None,
                          detail=f"the re-run of its batches {batches} stayed finite")
    found, detail, saved_to = probe.found, probe.found.detail, None
    if found.kind in CULPRIT_KINDS:
        try:
            saved_to = micro.save(batch_path, step, epoch, world.rank)
        except OSError as error:  # the other ranks wait for this report: never raise here
            detail += f"; the batch could not be saved to {batch_path}: {error}"
    return NanFinding(world.rank, found.kind, step, epoch, micro.batch_idx, found.module,
                      found.module_type, detail, saved_to)


class _SavedState:
    """What a re-run may change, captured before it: gradients (set aside, so the re-run
    starts from none), buffers, every module's attributes, the random generators."""

    def __init__(self, models: Iterable[nn.Module]) -> None:
        modules = list({id(m): m for model in models for m in model.modules()}.values())
        params = {id(p): p for module in modules for p in module.parameters(recurse=False)}
        self.grads = [(p, p.grad) for p in params.values()]
        for param in params.values():
            param.grad = None
        self.buffers = [(b, b.detach().clone()) for module in modules
                        for b in module.buffers(recurse=False)]
        # Attributes a forward rebinds (MoE load counts, caches, DDP's sync flags), and
        # train/eval mode; hooks live in dicts that stay the same objects.
        self.attributes = [(module, dict(vars(module))) for module in modules]
        self.rng = rng_state()

    def restore(self) -> None:
        for param, grad in self.grads:
            param.grad = grad
        with torch.no_grad():
            for buffer, value in self.buffers:
                buffer.copy_(value)
        for module, attributes in self.attributes:
            current = vars(module)
            for name in current.keys() - attributes.keys():
                del current[name]
            current.update(attributes)
        set_rng_state(self.rng)


@dataclass(frozen=True)
class _Found:
    kind: FindingKind
    module: str | None
    module_type: str | None
    detail: str


class _Call:
    """One call of a module during the re-run."""

    __slots__ = ("aliases", "inputs_finite", "module", "name", "output_grad_finite",
                 "passed_through")

    def __init__(self, name: str, module: nn.Module) -> None:
        self.name, self.module = name, module
        self.inputs_finite: torch.Tensor | None = None
        self.output_grad_finite = True
        self.aliases: list[torch.Tensor] = []
        self.passed_through: set[int] = set()
        """Inputs returned as they are (``Dropout(0)``, ``Identity``): their gradient is the
        output's, which says nothing about this module."""


class _Probe:
    """Hooks on every module of every model that record the first non-finite value.

    A module is blamed when its own inputs were finite and its output was not (forward), or
    when the gradient of its output was finite and that of an input or of one of its own
    parameters was not (backward). Children finish their forward, and their backward reaches
    their inputs, before their parents do, so the first module blamed is the innermost one.
    Each module's tensor inputs are handed to it as aliases (``view_as``), so that an
    input's gradient is that module's own contribution, not the sum over every consumer.
    """

    def __init__(self, models: Mapping[str, nn.Module]) -> None:
        self.modules: list[tuple[str, nn.Module]] = []
        for model_name, model in models.items():
            for name, module in unwrap_ddp(model).named_modules():
                self.modules.append((clean_name(f"{model_name}.{name}" if name else model_name),
                                     module))
        self.roots = {id(unwrap_ddp(model)): name for name, model in models.items()}
        self.found: _Found | None = None
        self._handles: list[RemovableHandle] = []
        self._calls: dict[int, list[_Call]] = {}
        self._bad_output_grad: set[int] = set()
        self._root_grad: str | None = None

    def __enter__(self) -> Self:
        for name, module in self.modules:
            self._handles.append(module.register_forward_pre_hook(
                functools.partial(self._pre_forward, name), with_kwargs=True))
            self._handles.append(module.register_forward_hook(
                functools.partial(self._post_forward, name), with_kwargs=True))
            for param_name, param in module.named_parameters(recurse=False):
                if param.requires_grad:
                    self._handles.append(param.register_hook(
                        functools.partial(self._param_grad, name, module, param_name)))
        return self

    def __exit__(self, *exc_info: object) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    # -- what the re-run of one micro-batch shows -------------------------------------------
    def check_batch(self, batch: Any) -> None:
        bad = [t for t in _floats(batch) if not _finite([t])]
        if bad and self.found is None:
            self.found = _Found("batch", None, None, f"the batch itself holds {_what(bad)}, "
                                "before any module ran")

    def check_result(self, result: Mapping[str, Any], keys: Iterable[str]) -> None:
        if self.found is not None:
            return
        values = {key: result[key] for key in keys
                  if isinstance(result.get(key), torch.Tensor)}
        bad = {key: value for key, value in values.items() if not _finite([value.detach()])}
        if self._root_grad is not None:
            self.found = _Found("loss", self._root_grad, None, (
                f"every module's output was finite, but the gradient reaching "
                f"{self._root_grad}'s output was not: the loss, or training_step's code "
                "after the model, produced it"))
        elif bad:
            values_text = ", ".join(f"{key}={_what([value.detach()])}"
                                    for key, value in bad.items())
            self.found = _Found("loss", None, None, (
                f"every module's output and gradient was finite, but {values_text}: the loss "
                "computation in training_step produced it"))

    def failed(self, error: Exception) -> None:
        if self.found is None:
            first_line = (str(error).splitlines() or [""])[0]
            self.found = _Found("error", None, None,
                                f"the re-run raised {type(error).__name__}: {first_line}")

    # -- hooks -------------------------------------------------------------------------------
    def _pre_forward(self, name: str, module: nn.Module, args: tuple[Any, ...],
                     kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
        call = _Call(name, module)
        self._calls.setdefault(id(module), []).append(call)
        if self.found is not None:
            return None
        # Read on the host only if the output turns out non-finite (and before the module
        # could change its inputs in place).
        call.inputs_finite = _finite_flag(_floats((args, kwargs)))
        if not torch.is_grad_enabled():
            return None
        return (tuple(self._alias(call, value) for value in args),
                {key: self._alias(call, value) for key, value in kwargs.items()})

    def _post_forward(self, name: str, module: nn.Module, args: tuple[Any, ...],
                      kwargs: dict[str, Any], output: Any) -> None:
        call = self._calls[id(module)].pop()
        if self.found is not None:
            return
        outputs = _floats(output)
        if not _finite(outputs) and (call.inputs_finite is None or bool(call.inputs_finite)):
            broken = [p for p in module.parameters(recurse=False) if not _finite([p.detach()])]
            note = "; its own parameters are already non-finite (an earlier update broke " \
                   "them)" if broken else ""
            self.found = _Found("forward", name, type(module).__name__,
                                f"made {_what(outputs)} in forward: its inputs were finite, "
                                f"its output is not{note}")
            return
        call.passed_through = {id(t) for t in outputs} & {id(a) for a in call.aliases}
        call.aliases = []
        root = self.roots.get(id(module))
        for tensor in outputs:
            if tensor.requires_grad:
                self._handles.append(tensor.register_hook(
                    functools.partial(self._output_grad, call, id(module), root)))

    def _alias(self, call: _Call, value: Any) -> Any:
        if not (isinstance(value, torch.Tensor) and value.requires_grad
                and (value.is_floating_point() or value.is_complex())):
            return value
        alias = value.view_as(value)
        call.aliases.append(alias)
        self._handles.append(alias.register_hook(
            functools.partial(self._input_grad, call, id(alias))))
        return alias

    def _output_grad(self, call: _Call, module_id: int, root: str | None,
                     grad: torch.Tensor) -> None:
        if self.found is not None or _finite([grad]):
            return
        call.output_grad_finite = False
        self._bad_output_grad.add(module_id)
        if root is not None and self._root_grad is None:
            self._root_grad = root

    def _input_grad(self, call: _Call, alias_id: int, grad: torch.Tensor) -> None:
        if self.found is not None or not call.output_grad_finite \
                or alias_id in call.passed_through or _finite([grad]):
            return
        self.found = _Found("backward", call.name, type(call.module).__name__,
                            f"made {_what([grad])} in backward: the gradient of its output "
                            "was finite, the gradient of its input is not")

    def _param_grad(self, name: str, module: nn.Module, param_name: str,
                    grad: torch.Tensor) -> None:
        if self.found is not None or id(module) in self._bad_output_grad or _finite([grad]):
            return
        self.found = _Found("backward", name, type(module).__name__,
                            f"made {_what([grad])} in backward: the gradient of its output "
                            f"was finite, the gradient of its parameter {param_name!r} is not")


def _floats(value: Any) -> list[torch.Tensor]:
    """The floating-point (and complex) dense tensors in a nested structure."""
    return [t for t in _tensors(value) if t.layout == torch.strided
            and (t.is_floating_point() or t.is_complex())]


def _tensors(value: Any) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, Mapping):
        for item in value.values():
            yield from _tensors(item)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors(item)


def _finite_flag(tensors: list[torch.Tensor]) -> torch.Tensor | None:
    """Whether every element is finite, as a device tensor (no host sync); None if none."""
    if not tensors:
        return None
    return torch.stack([torch.isfinite(t.detach()).all() for t in tensors]).all()


def _finite(tensors: list[torch.Tensor]) -> bool:
    flag = _finite_flag(tensors)
    return flag is None or bool(flag)


def _what(tensors: list[torch.Tensor]) -> str:
    """"NaN", "inf" or "NaN and inf": what the non-finite elements of ``tensors`` are."""
    nan = any(bool(torch.isnan(t.detach()).any()) for t in tensors)
    inf = any(bool(torch.isinf(t.detach()).any()) for t in tensors)
    return "NaN and inf" if nan and inf else "NaN" if nan else "inf"
