"""The import-linter contracts of pyproject.toml ([tool.importlinter]) hold: `lint-imports` passes."""

from __future__ import annotations

import ast
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]
LINT_IMPORTS = "import sys; from importlinter.cli import lint_imports_command; sys.exit(lint_imports_command())"


def test_lint_imports_keeps_every_contract(tmp_path):
    if importlib.util.find_spec("importlinter") is None:
        pytest.fail("import-linter is not installed: run hack/setup (requirements/dev.lock pins it)", pytrace=False)
    # From a folder of its own, with --no-cache: lint-imports would write its cache into the repository.
    done = subprocess.run(
        [sys.executable, "-c", LINT_IMPORTS, "--config", str(ROOT / "pyproject.toml"), "--no-cache"],
        cwd=tmp_path, capture_output=True, text=True, timeout=120,
    )
    assert done.returncode == 0, f"lint-imports exited {done.returncode}:\n{done.stdout}{done.stderr}"
    assert "0 broken" in done.stdout, done.stdout


PACKAGES = ("kubetrain",)  # the one package: its folders are its subpackages


def import_cycles(graph) -> list[list[str]]:
    """The groups of modules that import one another, directly or through others, imports inside functions
    included (Tarjan's strongly connected components of the import graph, those of more than one module)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(module: str) -> None:  # recursive: a chain of imports is far shorter than the recursion limit
        index[module] = low[module] = len(index)
        stack.append(module)
        for imported in graph.find_modules_directly_imported_by(module):
            if imported not in graph.modules:
                continue
            if imported not in index:
                visit(imported)
                low[module] = min(low[module], low[imported])
            elif imported in stack:
                low[module] = min(low[module], index[imported])
        if low[module] == index[module]:
            group = []
            while True:
                member = stack.pop()
                group.append(member)
                if member == module:
                    break
            if len(group) > 1:
                cycles.append(sorted(group))

    for module in sorted(graph.modules):
        if module not in index:
            visit(module)
    return cycles


def test_no_module_imports_one_that_imports_it_back():
    import grimp

    cycles = import_cycles(grimp.build_graph(*PACKAGES, cache_dir=None))
    assert cycles == [], "import cycles (each group imports itself back):\n" + "\n".join(map(str, cycles))


def test_the_cycle_finder_finds_a_cycle(tmp_path, monkeypatch):
    import grimp

    pkg = tmp_path / "cyclic"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from . import b\n")
    (pkg / "b.py").write_text("def f():\n    from .a import x\n")  # inside a function: a cycle all the same
    (pkg / "c.py").write_text("from . import a\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert import_cycles(grimp.build_graph("cyclic", cache_dir=None)) == [["cyclic.a", "cyclic.b"]]


FOLDERS = ("kubetrain",)


def private_imports(source: str) -> list[str]:
    """`from X import _name` where X is one of the project's modules (relative, or a kubetrain* package):
    a private name used outside its module. Dunders (`__version__`) are not private."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.ImportFrom):
            continue
        ours = node.level > 0 or (node.module or "").split(".")[0].startswith("kubetrain")
        for alias in node.names if ours else ():
            if alias.name.startswith("_") and not alias.name.startswith("__"):
                found.append(f"line {node.lineno}: from {'.' * node.level}{node.module or ''} import {alias.name}")
    return found


def test_no_module_imports_another_modules_private_name():
    found = {str(path.relative_to(ROOT)): hits for folder in FOLDERS for path in sorted((ROOT / folder).rglob("*.py"))
             if (hits := private_imports(path.read_text()))}
    assert found == {}, found


def test_a_private_import_is_found():
    assert private_imports("from .schema import Problem, _short\nfrom torch import _C\nfrom .. import __version__\n"
                           "from kubetrain.trainer.data import _x as y\n") == [
        "line 1: from .schema import _short", "line 4: from kubetrain.trainer.data import _x"]
