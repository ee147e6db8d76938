"""Every import printed in a Python block of any Markdown file in the repository runs: a renamed or moved module
breaks this test, not a reader's paste. Files the docs tell a user to write (a block whose first line is
``# mine.py``) are written first, so ``from mine import load`` imports the docs' own ``mine.py``."""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SKIP = {".git", "node_modules", ".venv", "venv", "kiln.egg-info", "__pycache__", ".pytest_cache"}
MARKDOWN = sorted(p for p in REPO.rglob("*.md") if not SKIP & set(p.relative_to(REPO).parts))


def python_blocks(path: Path) -> list[str]:
    return [
        text for lang, text in re.findall(r"^```(\w*)\n(.*?)^```", path.read_text(), re.M | re.S) if lang == "python"
    ]


def project_file(text: str) -> str | None:
    """The file a block is, from its first line (``# mine.py``), as tests/e2e/test_docs.py reads it."""
    found = re.match(r"#\s+([\w./-]+\.py)\b", text.splitlines()[0] if text.strip() else "")
    return found.group(1) if found else None


def imports(text: str) -> list[str]:
    """The block's import statements (top level or nested), as source."""
    tree = ast.parse(text)
    return [ast.unparse(n) for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))]


def test_the_docs_have_imports_to_check() -> None:
    found = {p.relative_to(REPO).as_posix() for p in MARKDOWN if any(imports(b) for b in python_blocks(p))}
    assert {"README.md", "docs/engines.md"} <= found


@pytest.mark.parametrize("doc", [p for p in MARKDOWN if python_blocks(p)], ids=lambda p: p.relative_to(REPO).as_posix())
def test_every_import_printed_in_the_docs_runs(doc: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for other in MARKDOWN:  # the docs' project files, by the names the docs give them
        for text in python_blocks(other):
            name = project_file(text)
            if name:
                (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
                (tmp_path / name).write_text(text)
    monkeypatch.syspath_prepend(str(tmp_path))
    local = {p.stem for p in tmp_path.glob("*.py")}
    try:
        for text in python_blocks(doc):
            for statement in imports(text):
                try:
                    exec(statement, {})
                except ImportError as exc:
                    raise AssertionError(f"{doc.relative_to(REPO)}: `{statement}` fails: {exc}") from None
    finally:
        for name in local:
            sys.modules.pop(name, None)
