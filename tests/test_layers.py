"""The package's layers: no module imports one from a higher layer (checked with grimp over
every import statement, those inside functions included)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import grimp
import pytest

import dream_trainer

# Lowest first; folders on one line are one layer and may import each other. A new folder must
# be placed here deliberately (test_every_folder_has_a_layer).
LAYERS: tuple[tuple[str, ...], ...] = (
    ("errors", "configs"),
    ("world",),
    ("parallel", "data", "utils", "optim", "nn"),
    ("trainer",),
    ("checkpoint", "weights", "ft"),
    ("mixins",),
    ("callbacks",),
    ("dream",),
    ("planning",),
    ("cli", "__main__"),
)
LEVEL = {name: level for level, names in enumerate(LAYERS) for name in names}


def layer_of(module: str) -> str | None:
    """The first component under the package (None for the package itself, which re-exports
    the public names and sits above everything)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else None


def upward_imports(graph: grimp.ImportGraph) -> list[str]:
    """Every import of a higher layer's module, as ``importer:line -> imported``."""
    found = []
    for importer in sorted(graph.modules):
        for imported in sorted(graph.find_modules_directly_imported_by(importer)):
            low, high = layer_of(importer), layer_of(imported)
            if low is None or high is None or LEVEL[high] <= LEVEL[low]:
                continue
            lines = [detail["line_number"] for detail in
                     graph.get_import_details(importer=importer, imported=imported)]
            found.append(f"{importer}:{','.join(map(str, lines)) or '?'} -> {imported}")
    return found


@pytest.fixture
def graph() -> grimp.ImportGraph:
    return grimp.build_graph("dream_trainer")  # grimp caches the parse: ~0.1 s


def test_no_module_imports_a_higher_layer(graph: grimp.ImportGraph) -> None:
    assert upward_imports(graph) == []


def test_an_upward_import_is_reported(graph: grimp.ImportGraph) -> None:
    graph.add_import(importer="dream_trainer.configs.training", imported="dream_trainer.cli.plan",
                     line_number=7, line_contents="from dream_trainer.cli.plan import plan")
    assert upward_imports(graph) == [
        "dream_trainer.configs.training:7 -> dream_trainer.cli.plan"]


def test_every_folder_has_a_layer(graph: grimp.ImportGraph) -> None:
    folders = {layer_of(module) for module in graph.modules} - {None}
    assert folders <= set(LEVEL), f"place {sorted(folders - set(LEVEL))} in LAYERS"
    assert dream_trainer.__name__ == "dream_trainer"


PACKAGE = Path(dream_trainer.__file__).parent


def sources(*folders: str) -> dict[str, ast.Module]:
    return {str(path.relative_to(PACKAGE.parent)): ast.parse(path.read_text())
            for folder in folders for path in sorted((PACKAGE / folder).rglob("*.py"))}


def test_only_planning_knows_about_fake_tensors() -> None:
    # The fake *backend* is a world matter (it needs no store); fake tensors, which only a
    # tool wants, reach setup through a Materialization that planning supplies.
    outside = [path for path in sorted(PACKAGE.rglob("*.py"))
               if "planning" not in path.relative_to(PACKAGE).parts]
    found = [f"{path.relative_to(PACKAGE.parent)}:{number}"
             for path in outside
             for number, line in enumerate(path.read_text().splitlines(), 1)
             if re.search(r"fake_tensor|FakeTensor|fake_mode|is_fake", line)]
    assert found == []


def trainer_assignments(tree: ast.Module) -> list[int]:
    """Lines assigning an attribute of ``trainer`` or ``self.trainer``, or setattr on it."""
    def is_trainer(node: ast.expr) -> bool:
        return (isinstance(node, ast.Name) and node.id == "trainer") or (
            isinstance(node, ast.Attribute) and node.attr == "trainer")

    lines = []
    for node in ast.walk(tree):
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) \
                and node.func.id == "setattr" and node.args and is_trainer(node.args[0]):
            lines.append(node.lineno)
        lines += [target.lineno for target in targets
                  if isinstance(target, ast.Attribute) and is_trainer(target.value)]
    return lines


def test_tools_assign_no_trainer_attribute() -> None:
    found = {path: lines for path, tree in sources("cli", "planning").items()
             if (lines := trainer_assignments(tree))}
    assert found == {}
    injected = ast.parse("def run(trainer):\n    trainer.config = None\n"
                         "    setattr(trainer, 'model', None)\n")
    assert trainer_assignments(injected) == [2, 3]
