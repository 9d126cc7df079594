"""The documentation site builds without a warning, and documents every public name.

A name in a package's ``__all__`` counts as documented when a page in ``docs/api/`` has a
mkdocstrings block (a line ``::: <import path>``) whose path imports that very object, so the
reference shows its real signature and docstring. Every API page must be linked from
``docs/api/index.md``, and every page under ``docs/`` must be in the ``mkdocs.yml`` nav.
"""

from __future__ import annotations

import importlib
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

from tests.helpers.launch import REPO, child_env
from tests.test_public_api import SNAPSHOT

DOCS = REPO / "docs"
API = DOCS / "api"
DIRECTIVE = re.compile(r"^::: *(?P<path>[\w.]+) *$", re.MULTILINE)


def import_path(path: str) -> Any:
    """The object a dotted path names: the longest importable module, then attributes."""
    parts = path.split(".")
    for split in range(len(parts), 0, -1):
        try:
            target = importlib.import_module(".".join(parts[:split]))
        except ModuleNotFoundError:
            continue
        for name in parts[split:]:
            target = getattr(target, name)
        return target
    raise ImportError(path)


def api_pages() -> list[Path]:
    return sorted(page for page in API.glob("*.md") if page.name != "index.md")


def documented_objects() -> dict[int, tuple[Any, Path]]:
    """id(object) -> (object, page) for every ``:::`` block of the API pages."""
    found: dict[int, tuple[Any, Path]] = {}
    for page in api_pages():
        for match in DIRECTIVE.finditer(page.read_text()):
            target = import_path(match.group("path"))
            found[id(target)] = (target, page)
    return found


def nav_files(entry: Any) -> Iterator[str]:
    """Every page path in a mkdocs nav (nested lists of ``{title: path or list}``)."""
    if isinstance(entry, str):
        yield entry
    elif isinstance(entry, list):
        for item in entry:
            yield from nav_files(item)
    elif isinstance(entry, dict):
        for value in entry.values():
            yield from nav_files(value)


def snake_case(name: str) -> str:
    return re.sub(r"(?<=[a-z0-9])(?=[A-Z])|(?<=[A-Z])(?=[A-Z][a-z])", "_", name).lower()


def test_mkdocs_build_is_strict_clean(tmp_path: Path) -> None:
    site = tmp_path / "site"
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
        cwd=REPO, env=child_env(), capture_output=True, text=True, timeout=240)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    assert "WARNING" not in output, output
    assert (site / "index.html").is_file()
    page = (site / "api" / "training_parameters" / "index.html").read_text()
    # The mkdocstrings block rendered the signature of the pydantic model from its fields.
    assert "doc-signature" in page and "n_epochs" in page and "train_batch_size" in page
    assert not list(site.rglob("*.py")), "build code under docs/ must not be published"


def test_every_public_name_has_an_api_page() -> None:
    documented = documented_objects()
    missing = []
    for module_name, names in SNAPSHOT.items():
        module = importlib.import_module(module_name)
        for name in names:
            if id(getattr(module, name)) not in documented:
                missing.append(f"{module_name}.{name}: write docs/api/{snake_case(name)}.md "
                               f"with a '::: {module_name}.{name}' block (or add that block "
                               "to the page that documents it)")
    assert not missing, "undocumented public names:\n" + "\n".join(missing)


def test_every_api_page_is_linked_from_the_index_and_in_the_nav() -> None:
    index = (API / "index.md").read_text()
    nav = set(nav_files(yaml.safe_load((REPO / "mkdocs.yml").read_text())["nav"]))
    problems = []
    for page in api_pages():
        if f"]({page.name})" not in index:
            problems.append(f"docs/api/index.md does not link {page.name}")
        if f"api/{page.name}" not in nav:
            problems.append(f"mkdocs.yml nav lacks api/{page.name}")
    assert not problems, "\n".join(problems)


def test_every_docs_page_is_in_the_nav_and_every_nav_entry_exists() -> None:
    nav = set(nav_files(yaml.safe_load((REPO / "mkdocs.yml").read_text())["nav"]))
    pages = {page.relative_to(DOCS).as_posix() for page in DOCS.rglob("*.md")}
    assert not pages - nav, f"pages missing from the mkdocs.yml nav: {sorted(pages - nav)}"
    assert not nav - pages, f"nav entries without a page: {sorted(nav - pages)}"


def test_each_api_page_renders_the_symbol_its_heading_names() -> None:
    problems = []
    for page in api_pages():
        text = page.read_text()
        heading = text.splitlines()[0].removeprefix("# ").strip()
        blocks = [match.group("path") for match in DIRECTIVE.finditer(text)]
        if not blocks:
            problems.append(f"{page.name} has no '::: <import path>' block for {heading}")
        elif import_path(blocks[0]) is not import_path(heading):
            problems.append(f"{page.name}: its first block, '::: {blocks[0]}', does not "
                            f"document {heading}")
    assert not problems, "\n".join(problems)
