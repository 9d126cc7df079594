"""The package's layers: no module imports one from a higher layer, no two folders import
each other, and no two modules of one folder do (checked with grimp over every import
statement, those inside functions and under ``TYPE_CHECKING`` included, plus
``importlib.import_module``/``__import__`` of a module named in a string). Tools (cli,
planning) never assign state reached through the trainer."""

from __future__ import annotations

import ast
import re
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import grimp
import pytest

import dream_trainer

ROOT = "__init__"
"""The folder name given to the package's own ``__init__``: it re-exports the public names
of the top layers (``DreamTrainer``), so it is the top layer itself."""

# Lowest first. Folders on one line are one layer: they may import each other, but not both
# ways (test_no_two_folders_import_each_other). A new folder must be placed here deliberately
# (test_every_folder_has_a_layer).
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
    ("cli", "__main__", ROOT),
)
LEVEL = {name: level for level, names in enumerate(LAYERS) for name in names}

# The calls that import a module named by a string; grimp sees only import statements.
LOADERS = frozenset({"import_module", "__import__"})


def layer_of(module: str) -> str:
    """The first component under the package, or ``ROOT`` for the package itself."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ROOT


def import_lines(graph: grimp.ImportGraph, importer: str, imported: str) -> str:
    lines = [detail["line_number"] for detail in
             graph.get_import_details(importer=importer, imported=imported)]
    return ",".join(map(str, lines)) or "?"


def upward_imports(graph: grimp.ImportGraph) -> list[str]:
    """Every import of a higher layer's module, as ``importer:line -> imported``."""
    found = []
    for importer in sorted(graph.modules):
        for imported in sorted(graph.find_modules_directly_imported_by(importer)):
            if LEVEL[layer_of(imported)] > LEVEL[layer_of(importer)]:
                found.append(f"{importer}:{import_lines(graph, importer, imported)} -> "
                             f"{imported}")
    return found


def rings(edges: dict[tuple[str, str], list[str]]) -> dict[str, list[str]]:
    """Each set of nodes that reach one another along ``edges`` (``a <-> b``, or a longer
    ring), keyed by its sorted nodes, with the lines of every edge between them."""

    def reach(start: str) -> set[str]:
        seen, todo = {start}, [start]
        while todo:
            here = todo.pop()
            for low, high in edges:
                if low == here and high not in seen:
                    seen.add(high)
                    todo.append(high)
        return seen

    nodes = {node for pair in edges for node in pair}
    reached = {node: reach(node) for node in nodes}
    found = {}
    for node in sorted(nodes):
        ring = sorted(other for other in reached[node] if node in reached[other])
        if len(ring) > 1 and ring[0] == node:
            found[" <-> ".join(ring)] = [line for pair in sorted(edges)
                                         if set(pair) <= set(ring) for line in edges[pair]]
    return found


def folder_cycles(graph: grimp.ImportGraph) -> dict[str, list[str]]:
    """Each set of folders that import one another (``a <-> b``, or a longer ring), with every
    import between them as ``importer:line -> imported``."""
    edges: dict[tuple[str, str], list[str]] = {}
    for importer in sorted(graph.modules):
        for imported in sorted(graph.find_modules_directly_imported_by(importer)):
            pair = (layer_of(importer), layer_of(imported))
            if pair[0] != pair[1]:
                edges.setdefault(pair, []).append(
                    f"{importer}:{import_lines(graph, importer, imported)} -> {imported}")
    return rings(edges)


def member_of(folder: str, module: str) -> str | None:
    """The module of ``folder`` that holds ``module``: its file, or the subfolder it is in
    (one member, whatever it holds); ``ROOT`` for the folder's own ``__init__``; None
    outside the folder."""
    if module == folder:
        return ROOT
    if not module.startswith(f"{folder}."):
        return None
    return module[len(folder) + 1:].split(".")[0]


def module_cycles(graph: grimp.ImportGraph) -> dict[str, list[str]]:
    """Each set of modules of one folder below the package that import one another, keyed
    ``folder: a <-> b``, with every import between them as ``importer:line -> imported``.
    The package's own level is ``folder_cycles``'."""
    found = {}
    folders = sorted(module for module in graph.modules
                     if "." in module and graph.find_children(module))
    for folder in folders:
        edges: dict[tuple[str, str], list[str]] = {}
        for importer in sorted(graph.find_descendants(folder) | {folder}):
            for imported in sorted(graph.find_modules_directly_imported_by(importer)):
                pair = (member_of(folder, importer), member_of(folder, imported))
                if pair[1] is not None and pair[0] != pair[1]:
                    edges.setdefault((str(pair[0]), pair[1]), []).append(
                        f"{importer}:{import_lines(graph, importer, imported)} -> {imported}")
        found.update({f"{folder}: {ring}": lines for ring, lines in rings(edges).items()})
    return found


def string_loads(module: str, source: str) -> list[tuple[int, str]]:
    """``(line, name)`` of each ``import_module``/``__import__`` call in ``source`` whose
    first argument is a string naming a module of ``module``'s package."""
    package = module.split(".")[0]
    found = []
    for node in ast.walk(ast.parse(source)):
        if not (isinstance(node, ast.Call) and node.args):
            continue
        name = node.func.id if isinstance(node.func, ast.Name) else (
            node.func.attr if isinstance(node.func, ast.Attribute) else None)
        first = node.args[0]
        if name in LOADERS and isinstance(first, ast.Constant) and isinstance(first.value, str) \
                and first.value.split(".")[0] == package:
            found.append((node.lineno, first.value))
    return found


def add_string_loads(graph: grimp.ImportGraph, folder: Path, package: str) -> None:
    """Add every string load of the package's modules to ``graph`` as an import, of the
    longest module prefix of the name (``a.b.func`` loads ``a.b``)."""
    for path in sorted(folder.rglob("*.py")):
        parts = [package, *path.relative_to(folder).with_suffix("").parts]
        module = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        for line, name in string_loads(module, path.read_text()):
            pieces = name.split(".")
            imported = next((".".join(pieces[:end]) for end in range(len(pieces), 0, -1)
                             if ".".join(pieces[:end]) in graph.modules), name)
            graph.add_import(importer=module, imported=imported, line_number=line,
                             line_contents=f"import_module({name!r})")


PACKAGE = Path(dream_trainer.__file__).parent


@pytest.fixture
def graph() -> grimp.ImportGraph:
    graph = grimp.build_graph("dream_trainer")  # grimp caches the parse: ~0.1 s
    add_string_loads(graph, PACKAGE, "dream_trainer")
    return graph


def test_no_module_imports_a_higher_layer(graph: grimp.ImportGraph) -> None:
    assert upward_imports(graph) == []


def test_no_two_folders_import_each_other(graph: grimp.ImportGraph) -> None:
    assert folder_cycles(graph) == {}


def test_no_two_modules_of_a_folder_import_each_other(graph: grimp.ImportGraph) -> None:
    # A ring through an import inside a function or under TYPE_CHECKING is still one: the
    # reader of either module must read the other first.
    assert module_cycles(graph) == {}


def test_a_circle_inside_a_folder_is_reported(graph: grimp.ImportGraph) -> None:
    before = module_cycles(graph)
    added = [("dream_trainer.utils.text", "dream_trainer.utils.averaging", 3),
             ("dream_trainer.utils.averaging", "dream_trainer.utils", 4),
             ("dream_trainer.utils", "dream_trainer.utils.text", 5)]
    for importer, imported, line in added:
        graph.add_import(importer=importer, imported=imported, line_number=line,
                         line_contents=f"import {imported}")
    after = module_cycles(graph)
    assert {ring: after[ring] for ring in set(after) - set(before)} == {
        "dream_trainer.utils: __init__ <-> averaging <-> text": [
            "dream_trainer.utils:5 -> dream_trainer.utils.text",
            "dream_trainer.utils.averaging:4 -> dream_trainer.utils",
            "dream_trainer.utils.text:3 -> dream_trainer.utils.averaging"]}


def test_an_upward_import_is_reported(graph: grimp.ImportGraph) -> None:
    graph.add_import(importer="dream_trainer.configs.training", imported="dream_trainer.cli.plan",
                     line_number=7, line_contents="from dream_trainer.cli.plan import plan")
    assert upward_imports(graph) == [
        "dream_trainer.configs.training:7 -> dream_trainer.cli.plan"]


def test_every_folder_has_a_layer(graph: grimp.ImportGraph) -> None:
    folders = {layer_of(module) for module in graph.modules}
    assert folders <= set(LEVEL), f"place {sorted(folders - set(LEVEL))} in LAYERS"
    assert dream_trainer.__name__ == "dream_trainer"


def write_tree(root: Path, files: dict[str, str]) -> None:
    for name, source in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(textwrap.dedent(source))


def test_violations_in_a_module_tree_are_reported(tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    # A package laid out as dream_trainer is, with one of each violation the guards exist for:
    # the root package imported from a function of a lower layer, a string load of a higher
    # layer, and two folders of one layer importing each other.
    write_tree(tmp_path / "layered", {
        "__init__.py": "from layered.dream import DreamTrainer\n",
        "dream.py": "from layered.trainer.base import BaseTrainer\n"
                    "class DreamTrainer(BaseTrainer): ...\n",
        "trainer/__init__.py": "",
        "trainer/base.py": """\
            class BaseTrainer:
                def promote(self):
                    from layered import DreamTrainer
                    return DreamTrainer
            """,
        "configs/__init__.py": """\
            import importlib

            def plan():
                return importlib.import_module("layered.cli.plan").plan, __import__("layered")
            """,
        "cli/__init__.py": "",
        "cli/plan.py": "def plan(): ...\n",
        "checkpoint/__init__.py": "from layered.weights.export import export\n",
        "weights/__init__.py": "",
        "weights/export.py": "from layered.checkpoint import layout\n\n\ndef export(): ...\n",
        "checkpoint/layout.py": "",
    })
    monkeypatch.syspath_prepend(str(tmp_path))
    graph = grimp.build_graph("layered", cache_dir=None)
    add_string_loads(graph, tmp_path / "layered", "layered")
    assert upward_imports(graph) == ["layered.configs:4 -> layered",
                                     "layered.configs:4 -> layered.cli.plan",
                                     "layered.trainer.base:3 -> layered"]
    # The upward import also closes a ring through the root, which re-exports the top layer.
    assert folder_cycles(graph) == {
        "__init__ <-> dream <-> trainer": ["layered:1 -> layered.dream",
                                           "layered.dream:1 -> layered.trainer.base",
                                           "layered.trainer.base:3 -> layered"],
        "checkpoint <-> weights": ["layered.checkpoint:1 -> layered.weights.export",
                                   "layered.weights.export:1 -> layered.checkpoint.layout"]}
    assert "layered" not in sys.modules  # read, never imported


def test_a_subfolder_is_one_module_of_its_folder(tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    # ``inner.a`` and the subfolder ``inner.sub`` import each other through different
    # modules of ``sub``: one ring of ``inner``; inside ``sub``, x and y form another (one
    # import under TYPE_CHECKING, one inside a function).
    write_tree(tmp_path / "ringed", {
        "__init__.py": "",
        "inner/__init__.py": "",
        "inner/a.py": "from ringed.inner.sub.x import X\n",
        "inner/sub/__init__.py": "",
        "inner/sub/x.py": "from typing import TYPE_CHECKING\n\n"
                          "if TYPE_CHECKING:\n    from ringed.inner.sub.y import y\nX = 1\n",
        "inner/sub/y.py": "def y():\n    from ringed.inner import a\n"
                          "    from ringed.inner.sub import x\n",
    })
    monkeypatch.syspath_prepend(str(tmp_path))
    graph = grimp.build_graph("ringed", cache_dir=None)
    assert module_cycles(graph) == {
        "ringed.inner: a <-> sub": ["ringed.inner.a:1 -> ringed.inner.sub.x",
                                    "ringed.inner.sub.y:2 -> ringed.inner.a"],
        "ringed.inner.sub: x <-> y": ["ringed.inner.sub.x:4 -> ringed.inner.sub.y",
                                      "ringed.inner.sub.y:3 -> ringed.inner.sub.x"]}
    assert "ringed" not in sys.modules  # read, never imported


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


FUNCTIONS = (ast.FunctionDef, ast.AsyncFunctionDef)


def reaches_trainer(node: ast.expr, bound: set[str]) -> bool:
    """True for an attribute, item or method-call chain that starts at a name in ``bound``
    or passes through an attribute ``trainer`` (``trainer.world.dims``,
    ``self.trainer.named_models().items()``, ``model.runner`` with ``model`` in ``bound``)."""
    while isinstance(node, (ast.Attribute, ast.Subscript, ast.Call)):
        if isinstance(node, ast.Attribute) and node.attr == "trainer":
            return True
        node = node.func if isinstance(node, ast.Call) else node.value
    return isinstance(node, ast.Name) and node.id in bound


def _names(target: ast.expr) -> Iterator[str]:
    if isinstance(target, ast.Name):
        yield target.id
    elif isinstance(target, (ast.Tuple, ast.List)):
        for element in target.elts:
            yield from _names(element)
    elif isinstance(target, ast.Starred):
        yield from _names(target.value)


def _bindings(scope: ast.AST) -> Iterator[tuple[ast.expr, ast.expr]]:
    """``(target, value)`` of every name binding in ``scope`` that takes a value."""
    for node in ast.walk(scope):
        if isinstance(node, ast.Assign):
            yield from ((target, node.value) for target in node.targets)
        elif isinstance(node, (ast.AnnAssign, ast.NamedExpr)) and node.value is not None:
            yield node.target, node.value
        elif isinstance(node, (ast.For, ast.AsyncFor, ast.comprehension)):
            yield node.target, node.iter
        elif isinstance(node, ast.withitem) and node.optional_vars is not None:
            yield node.optional_vars, node.context_expr


def bound_to_trainer(scope: ast.AST) -> set[str]:
    """``trainer`` and every name ``scope`` binds, directly or through another such name,
    from a chain that ``reaches_trainer``."""
    bound = {"trainer"}
    grown = True
    while grown:
        before = len(bound)
        bound |= {name for target, value in _bindings(scope) if reaches_trainer(value, bound)
                  for name in _names(target)}
        grown = len(bound) > before
    return bound


def _outer_functions(node: ast.AST) -> Iterator[ast.AST]:
    for child in ast.iter_child_nodes(node):
        if isinstance(child, FUNCTIONS):
            yield child
        else:
            yield from _outer_functions(child)


def _assignments(scope: ast.AST, bound: set[str]) -> set[int]:
    lines = set()
    for node in ast.walk(scope):
        targets: list[ast.expr] = []
        if isinstance(node, (ast.Assign, ast.Delete)):
            targets = node.targets
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign, ast.For, ast.AsyncFor)):
            targets = [node.target]
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) \
                and node.func.id in ("setattr", "delattr") and node.args \
                and reaches_trainer(node.args[0], bound):
            lines.add(node.lineno)
        flat = [element for target in targets for element in
                (target.elts if isinstance(target, (ast.Tuple, ast.List)) else [target])]
        lines |= {target.lineno for target in flat
                  if isinstance(target, (ast.Attribute, ast.Subscript))
                  and reaches_trainer(target.value, bound)}
    return lines


def trainer_assignments(tree: ast.Module) -> list[int]:
    """Lines that change state reached through the trainer.

    The rule: no assignment (``=``, augmented, annotated, ``del``, a loop target) to an
    attribute or item of a chain that ``reaches_trainer``, and no ``setattr``/``delattr`` on
    one. Inside a function the chain may start at a name bound from the trainer anywhere in
    the outermost function around it (``for name, model in trainer.named_models().items()``
    makes ``model.runner = ...`` a violation; ``world = trainer.world`` makes ``world.x = 1``
    one). The trainer is the name ``trainer`` or an attribute ``.trainer``; a value passed
    to another function as an argument is not followed. Public methods (``replace_config``,
    ``PipelineStages.swap_runner``) are the seams a tool changes the run through.
    """
    lines = _assignments(tree, {"trainer"})
    for function in _outer_functions(tree):
        lines |= _assignments(function, bound_to_trainer(function))
    return sorted(lines)


def state_copies(tree: ast.Module) -> list[int]:
    """Lines that read or write an object's ``__dict__`` (``vars()`` included): a tool that
    copies another object's private state (``self.__dict__.update(runner.__dict__)``) depends
    on its internals instead of a seam."""
    return sorted({node.lineno for node in ast.walk(tree)
                   if (isinstance(node, ast.Attribute) and node.attr == "__dict__")
                   or (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                       and node.func.id == "vars")})


def test_tools_assign_no_trainer_state() -> None:
    found = {path: lines for path, tree in sources("cli", "planning").items()
             if (lines := trainer_assignments(tree) + state_copies(tree))}
    assert found == {}


def test_assignments_through_the_trainer_are_found() -> None:
    injected = ast.parse(textwrap.dedent("""\
        def run(trainer, other):
            trainer.config = None
            setattr(trainer, 'model', None)
            trainer.model.runner = None
            trainer.world.dims, ok = None, True
            self.trainer.models['model'] += 1
            setattr(trainer.world, 'rank', 0)
            world = trainer.world
            dims = world.dims
            dims.pp = 2
            for name, model in trainer.named_models().items():
                model.runner = None
            with trainer.sandbox() as box:
                del box.directory
            other.model.runner = None
            model_copy = make(trainer)
            model_copy.runner = None

        def elsewhere(model):
            model.runner = None
        """))
    assert trainer_assignments(injected) == [2, 3, 4, 5, 6, 7, 10, 12, 14]
    copied = ast.parse("class Planned:\n    def __init__(self, runner):\n"
                       "        self.__dict__.update(runner.__dict__)\n"
                       "        self.state = dict(vars(runner))\n")
    assert state_copies(copied) == [3, 4]
