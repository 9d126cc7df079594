"""``ModelSummary`` and ``TrainerSummary``: what is being trained, and how, printed once."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TextIO

from torch import nn
from typing_extensions import override

from dream_trainer.configs.device import MESH_DEGREES
from dream_trainer.nn.moe import active_parameters, moe_layers
from dream_trainer.parallel.dtensor import local_tensor
from dream_trainer.trainer.abstract import AbstractTrainer
from dream_trainer.trainer.base import BaseTrainer
from dream_trainer.trainer.callback import RankZeroCallback
from dream_trainer.trainer.schedulers import planned_optimizer_steps

if TYPE_CHECKING:
    from rich.console import Console


def _console(stream: TextIO | None) -> Console:
    """A console on ``stream``: the terminal's own settings, or plain text 100 columns wide."""
    # Imported here, as is rich's Table: `import dream_trainer.callbacks` must stay light.
    from rich.console import Console

    if stream is None:
        return Console()
    if stream.isatty():
        return Console(file=stream)
    return Console(file=stream, force_terminal=False, width=100)


@dataclass(frozen=True)
class ModuleRow:
    """One module of a model summary; counts include every submodule's parameters once."""

    name: str
    """Dotted path, starting with the model's attribute name on the trainer."""
    type: str
    """The module's class name."""
    depth: int
    """0 for the model itself, 1 for its children, and so on."""
    params: int
    trainable: int
    frozen: int


class ModelSummary(RankZeroCallback[AbstractTrainer]):
    """Print each model's modules and parameter counts, then its per-rank size once sharded.

    The counts are taken after ``configure_models`` (``post_configure``), while the models are
    still on the meta device; the sizes after setup (``post_setup``), from each parameter's
    local shard (``DTensor.to_local()``) on global rank 0.

    Args:
        max_depth: Deepest level of submodules listed (0: the models only).
        stream: Where to print; ``sys.stdout`` by default.

    Attributes:
        rows: One ``ModuleRow`` per listed module, model by model, parents before children.
        total_params: Parameters of every model (``trainable_params + frozen_params``).
        active_params: The parameters one token passes through (``active_parameters``): the
            total, but of each ``MoE`` layer's experts only ``top_k`` of ``num_experts``.
        local_bytes: Bytes of each model's parameters held by global rank 0 after setup.

    Raises:
        ValueError: if ``max_depth < 0``.
    """

    def __init__(self, max_depth: int = 2, stream: TextIO | None = None) -> None:
        if max_depth < 0:
            raise ValueError(f"ModelSummary max_depth must be >= 0, got {max_depth}")
        self.max_depth = max_depth
        self.stream = stream
        self.rows: list[ModuleRow] = []
        self.total_params = 0
        self.trainable_params = 0
        self.frozen_params = 0
        self.active_params = 0
        self.local_bytes: dict[str, int] = {}

    @override
    def post_configure(self) -> None:
        self.rows = []
        for name, model in self.trainer.named_models().items():
            for path, module in model.named_modules():
                depth = path.count(".") + 1 if path else 0
                if depth <= self.max_depth:
                    self.rows.append(_row(f"{name}.{path}" if path else name, module, depth))
        roots = [row for row in self.rows if row.depth == 0]
        self.total_params = sum(row.params for row in roots)
        self.trainable_params = sum(row.trainable for row in roots)
        self.frozen_params = sum(row.frozen for row in roots)
        self.active_params = sum(active_parameters(model)
                                 for model in self.trainer.named_models().values())
        from rich.table import Table

        console = _console(self.stream)
        for root in roots:
            table = Table(title=f"{root.name} ({root.type})")
            for column in ("Module", "Type"):
                table.add_column(column)
            for column in ("Params", "Trainable", "Frozen"):
                table.add_column(column, justify="right")
            for row in self.rows:
                if row.name == root.name or row.name.startswith(f"{root.name}."):
                    table.add_row("  " * row.depth + row.name, row.type, f"{row.params:,}",
                                  f"{row.trainable:,}", f"{row.frozen:,}")
            console.print(table)
        console.print(f"Total params: {self.total_params:,} (trainable {self.trainable_params:,}, "
                      f"frozen {self.frozen_params:,})", markup=False, highlight=False)
        if self.active_params != self.total_params:
            console.print(f"Active params per token: {self.active_params:,} (mixture of experts)",
                          markup=False, highlight=False)

    @override
    def post_setup(self) -> None:
        self.local_bytes = {
            name: sum(local_tensor(p).numel() * p.element_size() for p in model.parameters())
            for name, model in self.trainer.named_models().items()
        }
        console = _console(self.stream)
        ranks = self.trainer.world.world_size
        ep = self.trainer.world.dims.ep
        for name, size in self.local_bytes.items():
            console.print(f"{name}: {size / 1e6:.2f} MB ({size:,} bytes) of parameters on "
                          f"rank 0 (world size {ranks})", markup=False, highlight=False)
            layers = list(moe_layers(self.trainer.named_models()[name]))
            if layers:
                held = ", ".join(sorted({f"{layer.num_experts // ep} of {layer.num_experts}"
                                         for layer in layers}))
                console.print(f"{name}: {len(layers)} MoE layer(s), {held} experts per rank "
                              f"(expert_parallel={ep})", markup=False, highlight=False)


def _row(name: str, module: nn.Module, depth: int) -> ModuleRow:
    # numel() reads only the shape, so this works on meta tensors without storage.
    trainable = sum(p.numel() for p in module.parameters() if p.requires_grad)
    frozen = sum(p.numel() for p in module.parameters() if not p.requires_grad)
    return ModuleRow(name, type(module).__name__, depth, trainable + frozen, trainable, frozen)


class TrainerSummary(RankZeroCallback[BaseTrainer]):
    """Print the world, batch sizes, schedule and precision once setup is done.

    The values are also kept in ``summary``. The global batch is the samples that make one
    optimizer step: ``batch_size_per_rank * gradient_accumulation_steps * dp_size``.

    Args:
        stream: Where to print; ``sys.stdout`` by default.
    """

    def __init__(self, stream: TextIO | None = None) -> None:
        self.stream = stream
        self.summary: dict[str, Any] = {}

    @override
    def post_setup(self) -> None:
        trainer = self.trainer
        params = trainer.training_parameters
        device = trainer.config.device_parameters
        steps_per_epoch = trainer.train_steps_per_epoch
        layout = trainer.layout.describe(device)
        self.summary = {
            "world_size": trainer.world.world_size,
            "device": str(trainer.world.device),
            **{field: layout.degrees[field] for field in MESH_DEGREES},
            "batch_size_per_rank": params.train_batch_size,
            "gradient_accumulation_steps": params.gradient_accumulation_steps,
            "global_batch_size": trainer.global_batch_size,
            "optimizer_steps_per_epoch": steps_per_epoch,
            "n_epochs": params.n_epochs,
            "total_optimizer_steps": planned_optimizer_steps(params, steps_per_epoch),
            "param_dtype": str(device.param_dtype).removeprefix("torch."),
            "reduce_dtype": str(device.reduce_dtype).removeprefix("torch."),
            **layout.settings,
        }
        from rich.table import Table

        table = Table(title="Trainer")
        table.add_column("Setting")
        table.add_column("Value", justify="right")
        for key, value in self.summary.items():
            table.add_row(key, str(value))
        _console(self.stream).print(table)
