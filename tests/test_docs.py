"""Every fenced Python block in README.md and docs/ runs.

The blocks of one Markdown file run in order in one fresh namespace (in this process, in an
empty working directory), so a page can define a trainer in one block and use it in the
next; annotations are not evaluated, so signature blocks may name types without importing
them. A block preceded by the line ``<!-- test: torchrun -->`` is self-contained and runs on
its own under torchrun with 2 ranks.
"""

from __future__ import annotations

import __future__
import re
from pathlib import Path

import pytest

from tests.helpers.launch import REPO, check, torchrun

FENCE = re.compile(r"(?P<marker><!-- test: torchrun -->\s*\n)?^```python[^\n]*\n(?P<code>.*?)^```",
                   re.MULTILINE | re.DOTALL)


def markdown_files() -> list[Path]:
    """README.md and every docs page that has at least one python block."""
    candidates = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
    return [path for path in candidates if path.exists() and FENCE.search(path.read_text())]


def blocks(path: Path) -> tuple[list[str], list[str]]:
    """(blocks run in one interpreter, blocks run under torchrun)."""
    inline, distributed = [], []
    for match in FENCE.finditer(path.read_text()):
        (distributed if match.group("marker") else inline).append(match.group("code"))
    return inline, distributed


@pytest.mark.parametrize("path", markdown_files(), ids=lambda p: str(p.relative_to(REPO)))
def test_markdown_python_blocks_run(path: Path, tmp_path: Path,
                                    monkeypatch: pytest.MonkeyPatch) -> None:
    inline, distributed = blocks(path)
    name = str(path.relative_to(REPO))
    monkeypatch.chdir(tmp_path)
    namespace: dict[str, object] = {"__name__": "__main__"}
    for index, code in enumerate(inline):
        compiled = compile(code, f"{name} block {index}", "exec",
                           flags=__future__.annotations.compiler_flag, dont_inherit=True)
        exec(compiled, namespace)
    for index, code in enumerate(distributed):
        script = tmp_path / f"torchrun_{index}.py"
        script.write_text(code)
        check(torchrun(script, cwd=tmp_path))


def test_readme_and_api_pages_have_python_blocks() -> None:
    pages = {path.relative_to(REPO).as_posix() for path in markdown_files()}
    assert "README.md" in pages
    assert any(page.startswith("docs/api/") for page in pages)


def test_every_row_of_the_data_guides_exactness_table_names_a_test_that_exists() -> None:
    guide = (REPO / "docs/data.md").read_text()
    table = guide[guide.index("## What is exact when"):]
    rows = [line for line in table.splitlines() if line.startswith("| ") and "---" not in line]
    cited = [ref for row in rows[1:] for ref in re.findall(r"`(tests/[^`]+)`", row)]
    assert len(rows) > 10 and len(cited) >= len(rows) - 2  # one row states a limit
    for ref in cited:
        path, _, test = ref.partition("::")
        source = (REPO / path).read_text()
        assert not test or f"def {test}(" in source, ref
