"""The layers hold (STYLE.md; kopf keeps an import-linter contract for the same): read from the source's imports.

- The control plane (kubetrain_operator) imports nothing of the trainer, but
  for its command-line entry points, which import it inside the commands that
  need torch (checkpoints, bench) and never at module level.
- The trainer and the public API (kubetrain) import only the API model and
  the contracts of kubetrain_operator.api, never the control plane.
- The pure core (operator/api, operator/core) talks to no Kubernetes client
  and does no I/O of the controller or the local backend.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]
PACKAGES = {"operator": "kubetrain_operator", "trainer": "kubetrain_trainer", "kubetrain": "kubetrain"}
ENTRY_POINTS = {"kubetrain_operator.cli", "kubetrain_operator.benchcli"}
PURE = ("kubetrain_operator.api", "kubetrain_operator.core")
CLIENTS = ("kopf", "kubernetes", "kubetrain_operator.controller", "kubetrain_operator.local",
           "kubetrain_operator.report", "kubetrain_operator.cli")


def modules():
    for folder, package in PACKAGES.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = path.relative_to(ROOT / folder).with_suffix("").parts
            name = ".".join((package, *parts[:-1])) if parts[-1] == "__init__" else ".".join((package, *parts))
            yield name, path


def imports(name: str, path: Path) -> list[tuple[str, bool]]:
    """(imported module, at module level?) of every import in the file, relative ones resolved."""
    tree = ast.parse(path.read_text(), str(path))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    top_level = {id(node) for node in tree.body}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(alias.name, id(node) in top_level) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            found.append((module, id(node) in top_level))
    return found


def within(module: str, prefixes) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


ALL = list(modules())


@pytest.mark.parametrize("name,path", ALL, ids=[n for n, _ in ALL])
def test_each_module_imports_only_what_its_layer_may(name, path):
    wrong = []
    for module, top in imports(name, path):
        if name.startswith("kubetrain_operator") and within(module, ["kubetrain_trainer"]):
            if name not in ENTRY_POINTS or top:
                wrong.append(f"{module}: the control plane imports no trainer code"
                             + (" at module level" if name in ENTRY_POINTS else ""))
        if name == "kubetrain" and module == "kubetrain.client" and top:
            # kubetrain.Client: loaded on first use, never by a training script's `import kubetrain`
            wrong.append(f"{module}: kubetrain imports the client's facade only when asked (not at module level)")
        if name == "kubetrain.client" and module == "kubetrain_operator.client":
            pass  # the facade's own module: `import kubetrain.client` is asking for it
        elif not name.startswith("kubetrain_operator") and within(module, ["kubetrain_operator"]) \
                and not within(module, ["kubetrain_operator.api"]):
            wrong.append(f"{module}: the trainer reads only kubetrain_operator.api (the model and the contracts)")
        if within(name, PURE) and within(module, CLIENTS):
            wrong.append(f"{module}: the pure core does no Kubernetes or local I/O")
    assert not wrong, f"{path.relative_to(ROOT)}:\n  " + "\n  ".join(wrong)


def test_the_layer_check_sees_a_violation(tmp_path):
    bad = tmp_path / "plan.py"
    bad.write_text("import os\nfrom kubetrain_trainer.ddp import run_ddp\ndef f():\n    from ..controller import kube\n")
    found = imports("kubetrain_operator.core.plan", bad)
    assert ("kubetrain_trainer.ddp", True) in found and ("kubetrain_operator.controller", False) in found
